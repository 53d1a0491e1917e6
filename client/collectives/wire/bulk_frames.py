"""The bulk port's framing: what a connection opens with, and the tickets it carries.

A worker's bulk port (plaintext workers only) moves a tensor's raw bytes over
plain TCP beside gRPC. A connection opens with a prelude, ``MAGIC`` or
``MAGIC_ACKED`` followed by a ``TICKET_BYTES``-byte ticket that travelled in the
gRPC call authorising the transfer; after ``MAGIC_ACKED`` the worker answers
``ACK`` before any payload byte is sent. The SDK's client side is
:mod:`collectives.bulk`, the worker's listener ``collectives_server.worker.data.bulk``.
"""

from __future__ import annotations

import os

__all__ = [
    "ACK",
    "BULK_MIN_BYTES",
    "MAGIC",
    "MAGIC_ACKED",
    "NO_TICKET_MARK",
    "PRELUDE_BYTES",
    "TICKET_BYTES",
    "new_ticket",
]

MAGIC = b"CBK1"
# A put's prelude that asks the worker to acknowledge its ticket (one byte,
# ACK) before the payload: a worker that drops the connection (its bulk port is
# full) is then noticed before any byte is sent, and the put takes the stream.
MAGIC_ACKED = b"CBK2"
ACK = b"\x01"
# In the worker's DEADLINE_EXCEEDED when no connection presented a put's ticket.
NO_TICKET_MARK = "no bulk connection presented the ticket"
TICKET_BYTES = 16
# A connection's prelude: the magic, then the ticket.
PRELUDE_BYTES = len(MAGIC) + TICKET_BYTES
# Below this a payload goes through gRPC (one chunk): a connection costs more than it saves.
BULK_MIN_BYTES = 1 << 20


def new_ticket() -> bytes:
    """A one-time random ticket for one transfer."""
    return os.urandom(TICKET_BYTES)
