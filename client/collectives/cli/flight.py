"""``collectives trace`` and ``collectives diagnose``: the flight record from the shell.

``trace`` asks every rank for its flight record (``collectives.observe.flight_record``) and writes
the merged ops as Chrome Trace Event JSON (``collectives.observe.trace_events``) to ``--output``,
or, with ``--json``, prints the records. ``diagnose`` reads the same record
and prints every op in flight longer than ``--threshold-s`` (default: a
quarter of the op timeout) with the ranks it waits on (``collectives.observe.stuck_ops``).
Neither needs torch. Exit codes: 0 (nothing stuck), 1 (``diagnose``: an op is
stuck), 2 (the coordinator, or every worker, could not be reached).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import grpc

from collectives.observe.flight_record import FlightRecord, read_flight_record
from collectives.observe.stuck_ops import diagnose
from collectives.observe.trace_events import trace_events
from collectives.transport.channels import open_channel
from collectives.wire.cluster_state import ClusterSnapshot
from collectives.wire.security import ChannelSecurity

__all__ = ["EXIT_STUCK", "add_flight_commands", "run_diagnose", "run_trace"]

EXIT_OK = 0
EXIT_STUCK = 1
EXIT_UNREACHABLE = 2


def add_flight_commands(commands: Any) -> list[argparse.ArgumentParser]:
    """Adds ``trace`` and ``diagnose`` to the CLI's sub-commands; returns both parsers."""
    trace = commands.add_parser(
        "trace", help="write every rank's recent ops as a Chrome trace (Perfetto)"
    )
    trace.add_argument(
        "--last", type=int, default=1000, metavar="N", help="the last N ops (default 1000)"
    )
    out = trace.add_mutually_exclusive_group(required=True)
    out.add_argument("--output", metavar="FILE", help="write the Chrome Trace Event JSON here")
    out.add_argument("--json", action="store_true", help="print the merged records instead")
    diag = commands.add_parser(
        "diagnose", help="name the ops in flight too long and the ranks they wait on"
    )
    diag.add_argument(
        "--threshold-s",
        type=float,
        default=None,
        metavar="S",
        help="an op in flight longer than this is stuck (default: a quarter of the op timeout)",
    )
    diag.add_argument(
        "--last", type=int, default=200, metavar="N", help="ops read per rank (default 200)"
    )
    diag.add_argument("--json", action="store_true", help="print the verdict as JSON")
    for p in (trace, diag):
        p.add_argument(
            "--timeout",
            type=float,
            default=5.0,
            metavar="SECONDS",
            help="deadline for the coordinator, and for each worker's answer (default 5)",
        )
    return [trace, diag]


def _read(
    snapshot: ClusterSnapshot, security: ChannelSecurity, last: int, timeout: float
) -> FlightRecord:
    channels: list[grpc.Channel] = []

    def channel_for(address: str) -> grpc.Channel:
        channels.append(open_channel(address, security))
        return channels[-1]

    try:
        return read_flight_record(snapshot, channel_for, last=last, timeout=timeout)
    finally:
        for channel in channels:
            channel.close()


def _nobody_answered(command: str, record: FlightRecord) -> bool:
    if any(r.reply is not None for r in record.replies):
        return False
    why = "; ".join(f"rank {r.rank} at {r.address}: {r.error}" for r in record.replies)
    print(f"collectives {command}: no worker answered ({why or 'the cluster has no members'})",
          file=sys.stderr)  # fmt: skip
    return True


def run_trace(args: argparse.Namespace, snapshot: ClusterSnapshot) -> int:
    record = _read(snapshot, args.security, args.last, args.timeout)
    if _nobody_answered("trace", record):
        return EXIT_UNREACHABLE
    for reply in record.replies:
        if reply.reply is None:
            print(f"collectives trace: rank {reply.rank} did not answer: {reply.error}",
                  file=sys.stderr)  # fmt: skip
    if args.json:
        print(json.dumps([dataclasses.asdict(op) for op in record.ops], indent=2))
        return EXIT_OK
    now = max((r.reply.now_s for r in record.replies if r.reply is not None), default=None)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(trace_events(record.ops, now), f)
    print(f"wrote {len(record.ops)} ops on {len(record.replies)} ranks to {args.output} "
          "(open it in https://ui.perfetto.dev or chrome://tracing)")  # fmt: skip
    return EXIT_OK


def run_diagnose(args: argparse.Namespace, snapshot: ClusterSnapshot) -> int:
    record = _read(snapshot, args.security, args.last, args.timeout)
    if _nobody_answered("diagnose", record):
        return EXIT_UNREACHABLE
    threshold = args.threshold_s if args.threshold_s is not None else snapshot.op_timeout_s / 4
    stuck = diagnose(record, threshold)
    if args.json:
        print(json.dumps({
            "threshold_s": threshold,
            "stuck": [
                {"op_id": s.op.op_id, "generation": s.op.generation, "kind": s.op.kind,
                 "names": list(s.op.names), "phase": s.phase, "for_s": round(s.for_s, 3),
                 "waiting_on": list(s.waiting_on), "line": s.line}
                for s in stuck
            ],
        }, indent=2))  # fmt: skip
    elif stuck:
        for s in stuck:
            print(s.line)
    else:
        print(f"nothing stuck: no op in flight longer than {threshold:.1f} s on any of "
              f"{len(record.replies)} ranks")  # fmt: skip
    return EXIT_STUCK if stuck else EXIT_OK
