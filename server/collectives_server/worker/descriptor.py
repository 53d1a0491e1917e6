"""Op announcements through the process group itself.

The leader broadcasts each op as a length-prefixed, protobuf-encoded
``OpDescriptor`` inside a fixed-size uint8 tensor (one broadcast for every
descriptor that fits, a second one for the rest). Protobuf, never pickle:
a descriptor is data, not code.

The slot's header also carries the op's *inline capacity*: how many bytes of
operand data each rank appends to its operand description in the exchange
that follows (0: none; see ``handlers.tensor_ops``). The leader picks it, so
every rank sizes that exchange identically.

A *fused* announcement (``announce_batch``: several small ops queued together,
see ``fusion``) has a negative count where the capacity goes, and a body of
``count`` entries, each its own (length, capacity + 1) header and descriptor.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from collectives.v1 import worker_pb2
from collectives.wire.codec import tensor_memoryview

__all__ = ["announce", "announce_batch", "receive", "receive_batch", "Announced", "SLOT_BYTES"]

SLOT_BYTES = 1024
_HEAD = struct.Struct("<qq")  # body length, inline capacity + 1 (0: no inline data)
_MAX_BODY = 1 << 20
_MAX_BATCH = 1024


def _start_broadcast(pg: dist.ProcessGroup, t: torch.Tensor) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([t], opts)


def _broadcast(pg: dist.ProcessGroup, t: torch.Tensor) -> None:
    _start_broadcast(pg, t).wait()


class Announced:
    """The leader's pending broadcasts of one descriptor: :meth:`wait` before relying on
    their delivery. The leader may issue the op's next exchange first (the backend runs
    them in issue order on every rank), so it need not wait for its own send."""

    __slots__ = ("_tensors", "_works")

    def __init__(self, works: list[dist.Work], tensors: list[torch.Tensor]) -> None:
        self._works = works
        self._tensors = tensors  # alive until sent

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        self._tensors = []


def announce(
    pg: dist.ProcessGroup,
    desc: worker_pb2.OpDescriptor,
    inline: int | None = None,
    wait: bool = True,
) -> Announced:
    """Leader side: sends ``desc`` (and its inline capacity, None: no inline data) to
    every rank of ``pg`` (the leader is rank 0). With ``wait=False`` the returned
    handle must be waited on (its tensors stay alive with it)."""
    body = desc.SerializeToString()
    return _send(pg, body, 0 if inline is None else inline + 1, wait)


def announce_batch(
    pg: dist.ProcessGroup,
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
    return _send(pg, b"".join(parts), -len(items), wait)


def _send(pg: dist.ProcessGroup, body: bytes, second: int, wait: bool) -> Announced:
    head = _HEAD.pack(len(body), second)
    head += body[: SLOT_BYTES - _HEAD.size]
    slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
    tensor_memoryview(slot)[: len(head)] = head
    tensors = [slot]
    rest = body[SLOT_BYTES - _HEAD.size :]
    if rest:
        tensors.append(torch.frombuffer(bytearray(rest), dtype=torch.uint8))
    announced = Announced([_start_broadcast(pg, t) for t in tensors], tensors)
    if wait:
        announced.wait()
    return announced


def receive(pg: dist.ProcessGroup) -> tuple[worker_pb2.OpDescriptor, int | None]:
    """Follower side: waits for the leader's next descriptor; returns it and its inline
    capacity (a fused announcement is refused: use :func:`receive_batch`)."""
    items = receive_batch(pg)
    if len(items) != 1:
        raise ValueError(f"expected one op, the leader announced {len(items)} together")
    return items[0]


def receive_batch(pg: dist.ProcessGroup) -> list[tuple[worker_pb2.OpDescriptor, int | None]]:
    """Follower side: waits for the leader's next announcement; returns its ops (one,
    or several fused) with their inline capacities, in the leader's order."""
    slot = torch.empty(SLOT_BYTES, dtype=torch.uint8)
    _broadcast(pg, slot)
    raw = tensor_memoryview(slot)
    length, second = _HEAD.unpack_from(raw)
    if not 0 <= length <= _MAX_BODY or second < -_MAX_BATCH:
        raise ValueError(f"malformed op announcement (length {length}, field {second})")
    body = raw[_HEAD.size : _HEAD.size + length].tobytes()
    missing = length - len(body)
    if missing > 0:
        rest = torch.empty(missing, dtype=torch.uint8)
        _broadcast(pg, rest)
        body += tensor_memoryview(rest).tobytes()
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
