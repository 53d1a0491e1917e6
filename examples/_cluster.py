"""Shared by the examples: use a running cluster, or start a local one for the run."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import collectives


def parse_args(
    description: str,
    workers: int = 3,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """``--coordinator`` and ``--workers`` (default ``workers``), plus the example's own
    flags from ``add_arguments``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="a running cluster (e.g. from 'collectives-server local --workers 3'); "
        "default: start a local cluster of --workers workers for this run",
    )
    parser.add_argument("--workers", type=int, default=workers)
    if add_arguments is not None:
        add_arguments(parser)
    return parser.parse_args()


@contextlib.contextmanager
def cluster_for(args: argparse.Namespace) -> Iterator[collectives.Cluster]:
    if args.coordinator:
        with collectives.connect(args.coordinator, timeout=60) as cluster:
            yield cluster
        return
    argv = [sys.executable, "-m", "collectives_server", "local", "--workers", str(args.workers)]
    proc = subprocess.Popen(
        [*argv, "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        address = proc.stdout.readline().strip() if proc.stdout else ""
        if not address:
            raise SystemExit("collectives-server local did not start")
        print(f"started a local cluster of {args.workers} workers at {address}")
        with collectives.connect(address, timeout=120) as cluster:
            yield cluster
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
