"""Message size limits of the gRPC channels and servers on both sides.

Kept apart from :mod:`.codec` (which imports torch) so that the torch-free
channel setup (``collectives status``, the daemons' ``--help``) can use it.
"""

from __future__ import annotations

__all__ = ["MAX_MESSAGE_BYTES"]

# Largest gRPC message either side sends: a 4 MiB tensor chunk plus headers.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024 + 64 * 1024
