"""The ``collectives`` command: a look at a running cluster from the client side.

``collectives status --coordinator H:P`` asks the coordinator once
(``GetCluster``, with a deadline) and prints the membership as an aligned
table, or as one JSON object with ``--json`` for scripts and dashboards. It
does not wait for the cluster to form: a cluster that is still gathering
workers is shown as it is. Exit codes: 0 shown, 2 the coordinator could not be
reached (or a usage error), so scripts can tell "down" from "not formed".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from collectives._transport import call_unary, open_channel
from collectives.errors import CollectiveError
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives.workers import ClusterSnapshot, WorkerInfo

__all__ = ["fetch_status", "format_table", "main"]

EXIT_OK = 0
EXIT_UNREACHABLE = 2

_COLUMNS = ("RANK", "STATE", "ADDRESS", "HOSTNAME", "PID", "DEVICES", "JOINED_GEN", "HEARTBEAT")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collectives", description="Client-side tools for a collectives cluster."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = commands.add_parser(
        "status", help="show the cluster's generation and workers, as the coordinator sees them"
    )
    status.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    status.add_argument("--json", action="store_true", help="print one JSON object instead")
    status.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="deadline (default 5)"
    )
    return parser


def fetch_status(address: str, timeout: float) -> ClusterSnapshot:
    """One ``GetCluster`` call to the coordinator at ``address``.

    Raises:
        CollectiveError: no answer within ``timeout`` seconds (``UNAVAILABLE`` or
            ``DEADLINE_EXCEEDED``).
    """
    channel = open_channel(address)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        # wait_for_ready: keep trying to connect until the deadline rather than
        # failing on the first refused connection (the coordinator may be starting).
        msg = call_unary(
            stub.GetCluster,
            coordinator_pb2.GetClusterRequest(),
            timeout,
            f"GetCluster from {address}",
            wait_for_ready=True,
        )
    finally:
        channel.close()
    return ClusterSnapshot.from_proto(msg)


def _row(w: WorkerInfo) -> tuple[str, ...]:
    return (
        str(w.rank) if w.rank >= 0 else "-",
        w.state.value,
        w.address,
        w.hostname,
        str(w.pid),
        ",".join(w.devices),
        str(w.generation),
        f"{w.last_heartbeat_age_s:.1f}s",
    )


def format_table(address: str, snapshot: ClusterSnapshot) -> str:
    """The human-readable status: a header line, then one aligned row per worker."""
    header = (
        f"coordinator {address}  generation {snapshot.generation}  "
        f"world size {snapshot.world_size}  "
        f"formed {'yes' if snapshot.formed else 'no'}  "
        f"ready {'yes' if snapshot.ready else 'no'}  "
        f"status: {snapshot.status or '-'}"
    )
    rows = [_COLUMNS, *(_row(w) for w in snapshot.workers)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [header]
    for row in rows:
        lines.append(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    if not snapshot.workers:
        lines.append("(no workers registered)")
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        print("collectives status: --timeout must be positive", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        snapshot = fetch_status(args.coordinator, args.timeout)
    except CollectiveError as err:
        print(
            f"collectives status: cannot reach the coordinator at {args.coordinator} "
            f"within {args.timeout:g} s: {err}",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps({"coordinator": args.coordinator, **snapshot.to_dict()}, indent=2))
    else:
        print(format_table(args.coordinator, snapshot))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``collectives`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "status":
        return _status(args)
    return EXIT_UNREACHABLE  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    raise SystemExit(main())
