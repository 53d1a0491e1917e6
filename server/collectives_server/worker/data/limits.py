"""The data plane's limits, as plain values: what the bulk port and /dev/shm segments may hold.

Kept apart from the modules that enforce them (``bulk``, ``shm_segments``),
which need torch, so the command line can build them without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BulkLimits", "ShmLimits"]


@dataclass(frozen=True)
class BulkLimits:
    """What one bulk connection may hold, so no client can pin a worker's memory or
    connections for long; flags in ``cli/data_plane.py``."""

    # A ticket not presented within this long is void; a GET ticket pins its
    # tensor at most this long.
    ticket_ttl_s: float = 30.0
    # The whole prelude (magic + ticket) must arrive within this, in total.
    prelude_timeout_s: float = 5.0
    # A kept connection is closed after this long without a transfer (the SDK
    # drops its idle connections sooner, so it never sends on one being closed),
    # and a transfer that moves no byte for this long fails.
    idle_s: float = 60.0
    # Connections served at once, in all and from one peer host; more are closed at once.
    max_connections: int = 256
    max_connections_per_peer: int = 64


@dataclass(frozen=True)
class ShmLimits:
    """/dev/shm segments made for clients' gets: how many, how many bytes, how long kept."""

    max_segments: int = 64
    max_bytes: int = 2 << 30
    ttl_s: float = 30.0
