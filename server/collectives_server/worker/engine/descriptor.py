"""Op announcements through the group's control rounds (``control_rounds``).

The leader sends each op as an ``Announcement`` (``worker.proto``): the op's
``OpDescriptor`` and its *inline capacity*, how many bytes of operand data
each rank appends to its operand description in the exchange that follows
(absent: none; see ``handlers.tensor_ops``). The leader picks it, so every
rank sizes that exchange identically. A *fused* announcement
(``announce_batch``: several small ops queued together, see ``fusion``) holds
several. Protobuf, never pickle: a descriptor is data, not code.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from collectives.v1 import worker_pb2
from collectives_server.worker.engine.control_rounds import SLOT_BYTES, Waitable, rounds_of

__all__ = ["announce", "announce_batch", "receive", "receive_batch", "Announced", "SLOT_BYTES"]

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
    return announce_batch(pg, [(desc, inline)], wait)


def announce_batch(
    pg: object,
    items: list[tuple[worker_pb2.OpDescriptor, int | None]],
    wait: bool = True,
) -> Announced:
    """Leader side: announces several ops at once (each with its inline capacity); the
    followers' :func:`receive_batch` returns them in this order."""
    if not 1 <= len(items) <= _MAX_BATCH:
        raise ValueError(f"a fused announcement holds 1 to {_MAX_BATCH} ops, not {len(items)}")
    message = worker_pb2.Announcement(
        ops=[worker_pb2.AnnouncedOp(op=desc, inline_capacity=inline) for desc, inline in items]
    ).SerializeToString()
    if len(message) > _MAX_BODY:
        raise ValueError(f"an announcement of {len(message)} bytes is over {_MAX_BODY}")
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
    message = rounds_of(pg).receive_announcement(_MAX_BODY)
    try:
        ops = worker_pb2.Announcement.FromString(message).ops
    except DecodeError as exc:
        raise ValueError(f"malformed op announcement ({len(message)} bytes): {exc}") from None
    if not 1 <= len(ops) <= _MAX_BATCH:
        raise ValueError(f"malformed op announcement ({len(ops)} ops)")
    items = []
    for announced in ops:
        inline = announced.inline_capacity if announced.HasField("inline_capacity") else None
        if inline is not None and inline < 0:
            raise ValueError(f"malformed op announcement (inline capacity {inline})")
        items.append((announced.op, inline))
    return items
