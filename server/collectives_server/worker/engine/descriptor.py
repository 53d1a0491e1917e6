"""Op announcements through the group's control rounds (``control_rounds``).

The leader sends each op as a header and its protobuf-encoded
``OpDescriptor``. Protobuf, never pickle: a descriptor is data, not code.

The header carries the body's length and the op's *inline capacity*: how many
bytes of operand data each rank appends to its operand description in the
exchange that follows (0: none; see ``handlers.tensor_ops``). The leader picks
it, so every rank sizes that exchange identically.

A *fused* announcement (``announce_batch``: several small ops queued together,
see ``fusion``) has a negative count where the capacity goes, and a body of
``count`` entries, each its own (length, capacity + 1) header and descriptor.
"""

from __future__ import annotations

import struct

from collectives.v1 import worker_pb2
from collectives_server.worker.engine.control_rounds import SLOT_BYTES, Waitable, rounds_of

__all__ = ["announce", "announce_batch", "receive", "receive_batch", "Announced", "SLOT_BYTES"]

_HEAD = struct.Struct("<qq")  # body length, inline capacity + 1 (0: no inline data)
_MAX_BODY = 1 << 20
_MAX_BATCH = 1024


class Announced:
    """The leader's announcement of one op or run: :meth:`wait` before relying on its
    delivery. Over a process group the leader may issue the op's next exchange first
    (the backend runs them in issue order on every rank); over the control channel
    the message is already sent and waiting costs nothing."""

    __slots__ = ("_pending",)

    def __init__(self, pending: Waitable | None) -> None:
        self._pending = pending

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()


def announce(
    pg: object,
    desc: worker_pb2.OpDescriptor,
    inline: int | None = None,
    wait: bool = True,
) -> Announced:
    """Leader side: sends ``desc`` (and its inline capacity, None: no inline data) to
    every rank of ``pg`` (a ``ControlChannel`` or a process group; the leader is rank
    0). With ``wait=False`` the returned handle must be waited on."""
    body = desc.SerializeToString()
    return _send(pg, _HEAD.pack(len(body), 0 if inline is None else inline + 1) + body, wait)


def announce_batch(
    pg: object,
    items: list[tuple[worker_pb2.OpDescriptor, int | None]],
    wait: bool = True,
) -> Announced:
    """Leader side: announces several ops at once (each with its inline capacity); the
    followers' :func:`receive_batch` returns them in this order."""
    if not 1 <= len(items) <= _MAX_BATCH:
        raise ValueError(f"a fused announcement holds 1 to {_MAX_BATCH} ops, not {len(items)}")
    parts = []
    for desc, inline in items:
        body = desc.SerializeToString()
        parts.append(_HEAD.pack(len(body), 0 if inline is None else inline + 1))
        parts.append(body)
    body = b"".join(parts)
    return _send(pg, _HEAD.pack(len(body), -len(items)) + body, wait)


def _send(pg: object, message: bytes, wait: bool) -> Announced:
    announced = Announced(rounds_of(pg).announce(message))
    if wait:
        announced.wait()
    return announced


def receive(pg: object) -> tuple[worker_pb2.OpDescriptor, int | None]:
    """Follower side: waits for the leader's next descriptor; returns it and its inline
    capacity (a fused announcement is refused: use :func:`receive_batch`)."""
    items = receive_batch(pg)
    if len(items) != 1:
        raise ValueError(f"expected one op, the leader announced {len(items)} together")
    return items[0]


def receive_batch(pg: object) -> list[tuple[worker_pb2.OpDescriptor, int | None]]:
    """Follower side: waits for the leader's next announcement; returns its ops (one,
    or several fused) with their inline capacities, in the leader's order."""
    message = rounds_of(pg).receive_announcement(_HEAD.size + _MAX_BODY)
    if len(message) < _HEAD.size:
        raise ValueError(f"malformed op announcement ({len(message)} bytes)")
    length, second = _HEAD.unpack_from(message)
    body = message[_HEAD.size :]
    if length != len(body) or second < -_MAX_BATCH:
        raise ValueError(f"malformed op announcement (length {length}, field {second})")
    if second >= 0:
        return [(_parse(body), second - 1 if second else None)]
    items = []
    offset = 0
    for _ in range(-second):
        size, inline = _HEAD.unpack_from(body, offset)
        offset += _HEAD.size
        if size < 0 or offset + size > len(body) or inline < 0:
            raise ValueError("malformed fused op announcement")
        items.append((_parse(body[offset : offset + size]), inline - 1 if inline else None))
        offset += size
    return items


def _parse(body: bytes) -> worker_pb2.OpDescriptor:
    desc = worker_pb2.OpDescriptor()
    desc.ParseFromString(body)
    return desc
