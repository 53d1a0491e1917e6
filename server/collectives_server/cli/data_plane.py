"""Flags bounding the calls a client can hold on a worker's gRPC server.

See :mod:`collectives_server.rpc.limits`. ``worker`` takes them; ``local``
passes them on to its workers.
"""

from __future__ import annotations

import argparse
from typing import Any

from collectives_server.cli.common import byte_size, positive_float, positive_int
from collectives_server.rpc.limits import RpcLimits
from collectives_server.worker.data.limits import BulkLimits, ShmLimits

__all__ = ["add_data_plane_flags", "data_plane_args", "data_plane_from_args"]

_DEFAULTS = RpcLimits()
_SHM = ShmLimits()
_BULK = BulkLimits()


def add_data_plane_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data-plane bounds (see docs/security.md)")
    g.add_argument(
        "--max-rpc-s", type=positive_float, default=_DEFAULTS.max_rpc_s, metavar="S",
        help="longest any call may run, whatever the client's deadline, seconds "
        f"(default: {_DEFAULTS.max_rpc_s:g})",
    )  # fmt: skip
    g.add_argument(
        "--stream-idle-s", type=positive_float, default=_DEFAULTS.stream_idle_s, metavar="S",
        help="cancel a streaming call that makes no progress this long, seconds "
        f"(default: {_DEFAULTS.stream_idle_s:g})",
    )  # fmt: skip
    g.add_argument(
        "--max-data-streams", type=positive_int, default=_DEFAULTS.max_data_streams,
        metavar="N", help="data-plane calls (tensors, collectives, models) at once; more answer "
        f"RESOURCE_EXHAUSTED (default: {_DEFAULTS.max_data_streams})",
    )  # fmt: skip
    g.add_argument(
        "--max-data-streams-per-peer", type=positive_int,
        default=_DEFAULTS.max_data_streams_per_peer, metavar="N",
        help="the same, from one client host "
        f"(default: {_DEFAULTS.max_data_streams_per_peer})",
    )  # fmt: skip
    g.add_argument(
        "--bulk-ticket-ttl-s", type=positive_float, default=_BULK.ticket_ttl_s, metavar="S",
        help="a bulk ticket not presented within this is void; a GET ticket pins its tensor "
        f"at most this long (default: {_BULK.ticket_ttl_s:g})",
    )  # fmt: skip
    g.add_argument(
        "--bulk-prelude-timeout-s", type=positive_float, default=_BULK.prelude_timeout_s,
        metavar="S", help="a bulk connection must send its whole ticket prelude within this "
        f"(default: {_BULK.prelude_timeout_s:g})",
    )  # fmt: skip
    g.add_argument(
        "--bulk-idle-s", type=positive_float, default=_BULK.idle_s, metavar="S",
        help=f"close a bulk connection idle this long (default: {_BULK.idle_s:g})",
    )  # fmt: skip
    g.add_argument(
        "--max-bulk-connections", type=positive_int, default=_BULK.max_connections,
        metavar="N", help=f"bulk connections at once (default: {_BULK.max_connections})",
    )  # fmt: skip
    g.add_argument(
        "--max-bulk-connections-per-peer", type=positive_int,
        default=_BULK.max_connections_per_peer, metavar="N",
        help=f"the same, from one host (default: {_BULK.max_connections_per_peer})",
    )  # fmt: skip
    g.add_argument(
        "--shm-max-segments", type=positive_int, default=_SHM.max_segments, metavar="N",
        help="/dev/shm segments the worker holds for clients' gets; more answer "
        f"RESOURCE_EXHAUSTED (default: {_SHM.max_segments})",
    )  # fmt: skip
    g.add_argument(
        "--shm-max-bytes", type=byte_size, default=_SHM.max_bytes, metavar="N",
        help="their bytes in all (default: 2GiB)",
    )  # fmt: skip
    g.add_argument(
        "--shm-segment-ttl-s", type=positive_float, default=_SHM.ttl_s, metavar="S",
        help=f"a segment is unlinked this long after it was made (default: {_SHM.ttl_s:g})",
    )  # fmt: skip


def data_plane_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The WorkerConfig field these flags set."""
    return {
        "rpc_limits": RpcLimits(
            max_rpc_s=args.max_rpc_s,
            stream_idle_s=args.stream_idle_s,
            max_data_streams=args.max_data_streams,
            max_data_streams_per_peer=args.max_data_streams_per_peer,
        ),
        "bulk_limits": BulkLimits(
            ticket_ttl_s=args.bulk_ticket_ttl_s,
            prelude_timeout_s=args.bulk_prelude_timeout_s,
            idle_s=args.bulk_idle_s,
            max_connections=args.max_bulk_connections,
            max_connections_per_peer=args.max_bulk_connections_per_peer,
        ),
        "shm_limits": ShmLimits(
            max_segments=args.shm_max_segments,
            max_bytes=args.shm_max_bytes,
            ttl_s=args.shm_segment_ttl_s,
        ),
    }


def data_plane_args(args: argparse.Namespace) -> list[str]:
    """What ``local`` passes on to each worker."""
    return [
        f"--max-rpc-s={args.max_rpc_s}",
        f"--stream-idle-s={args.stream_idle_s}",
        f"--max-data-streams={args.max_data_streams}",
        f"--max-data-streams-per-peer={args.max_data_streams_per_peer}",
        f"--bulk-ticket-ttl-s={args.bulk_ticket_ttl_s}",
        f"--bulk-prelude-timeout-s={args.bulk_prelude_timeout_s}",
        f"--bulk-idle-s={args.bulk_idle_s}",
        f"--max-bulk-connections={args.max_bulk_connections}",
        f"--max-bulk-connections-per-peer={args.max_bulk_connections_per_peer}",
        f"--shm-max-segments={args.shm_max_segments}",
        f"--shm-max-bytes={args.shm_max_bytes}",
        f"--shm-segment-ttl-s={args.shm_segment_ttl_s}",
    ]
