"""The framing of every raw TCP connection beside gRPC: one prelude, one frame header.

Three kinds of connection travel outside gRPC: bulk transfers and call lanes
(to a worker's bulk port) and a generation's control channel (a follower to
its leader). All three open the same way, and those that carry more than one
message frame them the same way.

**The prelude** (:func:`prelude`, :func:`parse_prelude`): the magic ``b"CB"``,
a kind letter, a version digit, then a :data:`TOKEN_BYTES`-byte token:
:data:`PRELUDE_BYTES` in all. The receiver reads exactly that many bytes and
closes a connection whose magic, kind, version or token it does not know.

==========  ========  ==========================================================
kind        versions  after the prelude
==========  ========  ==========================================================
``BULK``    1, 2      one tensor's raw bytes, one way; the token is the ticket
                      from the gRPC call that authorised the transfer. Version
                      2 (a put): the worker answers :data:`ACK` before the
                      client sends a byte
``LANE``    1         the worker's :data:`ACK`, then one call at a time: a
                      request frame, its answer frame. The token is a ticket
                      from ``GetDataPlane(open_lane=true)``
``CONTROL`` 1         a ``HELLO`` frame (the follower's rank); the leader's
                      :data:`ACK` once every follower is in; then control frames.
                      The token is the one the leader published in the
                      generation's store
==========  ========  ==========================================================

**A frame** (:data:`FRAME_HEADER`): a kind byte and the payload's length
(u32), little-endian, then the payload. A lane's request frame has the method's
id as its kind and appends the seconds left of the call's deadline (f64) to
the header (:data:`LANE_REQUEST_HEADER`); its answer's kind is an outcome
(:data:`OK`, :data:`FAILED`, :data:`FAILED_CLOSING`) and its payload the
serialized response or ``google.rpc.Status``. A receiver checks each frame's
kind and length against what it expects before it reads the payload.

The lane's methods are named, not numbered by a table: a worker names the
methods its lanes carry in the ticket's answer (``DataPlaneResponse.lane_methods``),
a method's id being its position there (:func:`lane_method_ids`), so a client
and a worker of different releases agree on every id, and a method the worker
does not name takes gRPC.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

from collectives.wire.limits import MAX_MESSAGE_BYTES

__all__ = [
    "ACK",
    "BULK",
    "CONTROL",
    "CONTROL_BROADCAST",
    "CONTROL_HELLO",
    "CONTROL_ROW",
    "CONTROL_TABLE",
    "FAILED",
    "FAILED_CLOSING",
    "FIRST_LANE_METHODS",
    "FRAME_HEADER",
    "LANE",
    "LANE_REQUEST_HEADER",
    "MAX_FRAME_BYTES",
    "MAX_LANE_METHODS",
    "MAX_LANE_REQUEST_BYTES",
    "NO_TICKET_MARK",
    "OK",
    "PRELUDE_BYTES",
    "TOKEN_BYTES",
    "lane_method_ids",
    "new_token",
    "parse_prelude",
    "prelude",
]

MAGIC = b"CB"
BULK = b"K"
LANE = b"L"
CONTROL = b"C"
# The versions of each kind this release speaks (and accepts).
_VERSIONS = {BULK: (1, 2), LANE: (1,), CONTROL: (1,)}
TOKEN_BYTES = 16
PRELUDE_BYTES = len(MAGIC) + 2 + TOKEN_BYTES
# The one-byte answer that accepts a prelude (and, on the control channel, says
# that every follower is in).
ACK = b"\x01"

# A frame's header: kind (u8), payload bytes (u32).
FRAME_HEADER = struct.Struct("<BI")
MAX_FRAME_BYTES = (1 << 32) - 1
# A lane's request frame's header: the frame header (kind: the method's id), then
# the seconds left of the call's deadline (f64; 0 or less: the call has none).
LANE_REQUEST_HEADER = struct.Struct("<BId")

# A lane answer frame's kind: the call's outcome.
OK = 0
FAILED = 1
# Failed, and the worker closes the lane after this frame (the call was cancelled
# by the worker's limits, or the request frame was one it cannot read past).
FAILED_CLOSING = 2

# Control-channel frame kinds.
CONTROL_BROADCAST, CONTROL_ROW, CONTROL_TABLE, CONTROL_HELLO = 1, 2, 3, 4

# In the worker's DEADLINE_EXCEEDED when no connection presented a put's ticket.
NO_TICKET_MARK = "no bulk connection presented the ticket"

# The methods a worker of the first lane release carries, in id order (from 1):
# what a ticket's answer that names no methods means.
FIRST_LANE_METHODS: tuple[str, ...] = (
    "Forward",
    "Broadcast",
    "AllReduce",
    "Reduce",
    "AllGather",
    "Gather",
    "ReduceScatter",
    "AllToAll",
    "Barrier",
    "Backward",
)
# A method id is one byte.
MAX_LANE_METHODS = 255
# The largest request a lane carries (as a gRPC call would); the SDK sends larger
# ones through gRPC, and a worker refuses them, as gRPC does.
MAX_LANE_REQUEST_BYTES = MAX_MESSAGE_BYTES


def prelude(kind: bytes, token: bytes, version: int = 1) -> bytes:
    """The bytes a connection of ``kind`` (``BULK``, ``LANE``, ``CONTROL``) opens with."""
    if version not in _VERSIONS.get(kind, ()):
        raise ValueError(f"no version {version} of connection kind {kind!r}")
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a prelude's token is {TOKEN_BYTES} bytes, not {len(token)}")
    return MAGIC + kind + str(version).encode() + token


def parse_prelude(data: bytes | bytearray | memoryview) -> tuple[bytes, int, bytes] | None:
    """``(kind, version, token)`` of a prelude this release speaks, else None."""
    data = bytes(data)
    if len(data) != PRELUDE_BYTES or data[: len(MAGIC)] != MAGIC:
        return None
    kind, digit = data[2:3], data[3:4]
    if not digit.isdigit() or int(digit) not in _VERSIONS.get(kind, ()):
        return None
    return kind, int(digit), data[4:]


def new_token() -> bytes:
    """A one-time random token: a transfer's or a lane's ticket, a channel's secret."""
    return os.urandom(TOKEN_BYTES)


def lane_method_ids(named: Sequence[str]) -> dict[str, int]:
    """Each lane method's id, from the methods a worker named in a ticket's answer
    (``DataPlaneResponse.lane_methods``: ids are positions, from 1; an empty name is
    an id the worker does not serve); none named: the first lane release's."""
    methods = named or FIRST_LANE_METHODS
    return {name: i for i, name in enumerate(methods[:MAX_LANE_METHODS], start=1) if name}
