"""The real ``collectives-server`` parser, for tests of deployment files.

docker/compose.yaml, deploy/kubernetes and deploy/slurm write daemon command
lines (the arguments after the ``collectives-server`` entrypoint); their tests
parse each one here, so a flag that does not exist, or a combination the daemon
would refuse, fails in ``make test`` rather than in a container or a job.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Sequence

from collectives_server.cli.coordinator import config_from_args as coordinator_config
from collectives_server.cli.main import build_parser
from collectives_server.cli.worker import config_from_args as worker_config
from collectives_server.coordinator.daemon import CoordinatorConfig
from collectives_server.worker.config import WorkerConfig

__all__ = ["parse_coordinator", "parse_daemon", "parse_worker"]

DaemonConfig = CoordinatorConfig | WorkerConfig


def parse_daemon(argv: Sequence[str]) -> tuple[argparse.Namespace, DaemonConfig]:
    """The parsed arguments and the daemon's config, as ``collectives-server ARGV`` builds them.

    Raises:
        AssertionError: the parser (or the config built from it) refuses ``argv``;
            the message has argparse's complaint.
    """
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(list(argv))
            if args.command == "coordinator":
                return args, coordinator_config(args, args.parser)
            if args.command == "worker":
                return args, worker_config(args, args.parser)
    except SystemExit as exc:
        raise AssertionError(
            f"collectives-server refuses {list(argv)}:\n{stderr.getvalue().strip()}"
        ) from exc
    raise AssertionError(f"{list(argv)} runs {args.command!r}, not a daemon")


def parse_coordinator(argv: Sequence[str]) -> CoordinatorConfig:
    _, config = parse_daemon(argv)
    assert isinstance(config, CoordinatorConfig), f"{list(argv)} is not a coordinator"
    return config


def parse_worker(argv: Sequence[str]) -> WorkerConfig:
    _, config = parse_daemon(argv)
    assert isinstance(config, WorkerConfig), f"{list(argv)} is not a worker"
    return config
