"""The data plane's limits, as plain values: what the bulk port and /dev/shm segments may hold.

Kept apart from the modules that enforce them (``bulk``, ``shm_segments``),
which need torch, so the command line can build them without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from collectives_server.settings import (
    DATA_PLANE,
    byte_size,
    positive_float,
    positive_int,
    setting,
)

__all__ = ["BulkLimits", "ShmLimits"]


@dataclass(frozen=True)
class BulkLimits:
    """What one bulk connection may hold, so no client can pin a worker's memory or
    connections for long."""

    ticket_ttl_s: float = setting(
        30.0,
        flag="--bulk-ticket-ttl-s",
        parse=positive_float,
        metavar="S",
        group=DATA_PLANE,
        help="a bulk ticket not presented within this is void; a GET ticket pins its tensor "
        "at most this long",
    )
    prelude_timeout_s: float = setting(
        5.0,
        flag="--bulk-prelude-timeout-s",
        parse=positive_float,
        metavar="S",
        group=DATA_PLANE,
        help="a bulk connection must send its whole ticket prelude within this",
    )
    # The SDK drops its idle connections sooner, so it never sends on one being
    # closed; a transfer that moves no byte for this long fails too.
    idle_s: float = setting(
        60.0,
        flag="--bulk-idle-s",
        parse=positive_float,
        metavar="S",
        group=DATA_PLANE,
        help="close a bulk connection idle this long",
    )
    max_connections: int = setting(
        256,
        flag="--max-bulk-connections",
        parse=positive_int,
        metavar="N",
        group=DATA_PLANE,
        help="bulk connections at once",
    )
    max_connections_per_peer: int = setting(
        64,
        flag="--max-bulk-connections-per-peer",
        parse=positive_int,
        metavar="N",
        group=DATA_PLANE,
        help="the same, from one host",
    )


@dataclass(frozen=True)
class ShmLimits:
    """/dev/shm segments made for clients' gets: how many, how many bytes, how long kept."""

    max_segments: int = setting(
        64,
        flag="--shm-max-segments",
        parse=positive_int,
        metavar="N",
        group=DATA_PLANE,
        help="/dev/shm segments the worker holds for clients' gets; more answer RESOURCE_EXHAUSTED",
    )
    max_bytes: int = setting(
        2 << 30,
        flag="--shm-max-bytes",
        parse=byte_size,
        metavar="N",
        group=DATA_PLANE,
        shown_default="2GiB",
        help="their bytes in all",
    )
    ttl_s: float = setting(
        30.0,
        flag="--shm-segment-ttl-s",
        parse=positive_float,
        metavar="S",
        group=DATA_PLANE,
        help="a segment is unlinked this long after it was made",
    )
