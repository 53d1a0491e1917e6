"""``collectives drain`` and ``collectives rollout``: replacing workers from the shell.

``drain WORKER`` hands one member's rank to a live spare (``cluster.drain``:
every tensor it holds moves worker to worker, the drained worker exits 0 and
comes back as a spare); ``--shrink`` lets the rank leave when no spare is live.
``rollout`` drains every member in turn, each once a spare is live: a rolling
restart in which no call fails. Each drain prints one line (one JSON object
with ``--json``). Neither needs torch. Exit codes: 0 done, 1 a drain was refused
or failed (the message says why; a failed handoff leaves the rank where it was),
2 the coordinator could not be reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from collectives.errors import CollectiveError
from collectives.session import drains
from collectives.transport.channels import call_unary, open_channel
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives.wire.cluster_state import DrainReport

__all__ = ["add_drain_commands", "format_report", "run_drain", "run_rollout"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNREACHABLE = 2


def add_drain_commands(commands: Any) -> list[argparse.ArgumentParser]:
    """Adds ``drain`` and ``rollout`` to the CLI's sub-commands; returns both parsers."""
    drain = commands.add_parser(
        "drain", help="hand a member's rank, with its tensors, to a live spare"
    )
    drain.add_argument("worker", metavar="WORKER", help="the member's address or worker id")
    drain.add_argument(
        "--shrink",
        action="store_true",
        help="with no live spare, let the rank leave (its tensors are lost and listed)",
    )
    rollout = commands.add_parser(
        "rollout", help="drain every member in turn onto a spare (a rolling restart)"
    )
    for p in (drain, rollout):
        p.add_argument(
            "--timeout",
            type=float,
            default=120.0,
            metavar="SECONDS",
            help="how long each handoff (and, for rollout, each wait for a spare) may "
            "take (default 120)",
        )
        p.add_argument("--json", action="store_true", help="print each report as JSON")
    return [drain, rollout]


def format_report(report: DrainReport) -> str:
    """One line saying what a drain did."""
    onto = (
        f"onto {report.successor_id} at {report.successor}"
        if report.successor
        else f"shrinking the cluster ({len(report.lost)} tensors lost)"
    )
    mib = report.bytes_moved / 2**20
    return (
        f"drained {report.worker_id} at {report.worker} (rank {report.rank}) {onto}: "
        f"{report.tensors_moved} tensors, {mib:.1f} MiB, {report.models_moved} models "
        f"in {report.seconds:.2f} s (generation {report.generation_before} -> "
        f"{report.generation_after})"
    )


def _print(report: DrainReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps(dataclasses.asdict(report)), flush=True)
    else:
        print(format_report(report), flush=True)


def _op_timeout_s(stub: coordinator_pb2_grpc.CoordinatorStub, timeout: float) -> float:
    cluster = call_unary(
        stub.GetCluster, coordinator_pb2.GetClusterRequest(), timeout, "GetCluster"
    )
    return float(cluster.op_timeout_s) or 30.0


def run_drain(args: argparse.Namespace) -> int:
    return _run(args, rollout=False)


def run_rollout(args: argparse.Namespace) -> int:
    return _run(args, rollout=True)


def _run(args: argparse.Namespace, *, rollout: bool) -> int:
    command = "rollout" if rollout else "drain"
    if args.timeout <= 0:
        print(f"collectives {command}: --timeout must be positive", file=sys.stderr)
        return EXIT_UNREACHABLE
    channel = open_channel(args.coordinator, args.security)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            op_timeout_s = _op_timeout_s(stub, min(args.timeout, 10.0))
        except CollectiveError as err:
            print(f"collectives {command}: {err}", file=sys.stderr)
            return EXIT_UNREACHABLE
        try:
            if rollout:
                reports = drains.rollout(
                    stub,
                    timeout=args.timeout,
                    op_timeout_s=op_timeout_s,
                    on_report=lambda r: _print(r, args.json),
                )
                if not args.json:
                    print(f"rollout done: {len(reports)} members replaced", flush=True)
            else:
                report = drains.drain(
                    stub,
                    args.worker,
                    shrink=args.shrink,
                    timeout=args.timeout,
                    op_timeout_s=op_timeout_s,
                )
                _print(report, args.json)
        except CollectiveError as err:
            print(f"collectives {command}: {err}", file=sys.stderr)
            return EXIT_FAILED
    finally:
        channel.close()
    return EXIT_OK
