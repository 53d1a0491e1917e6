"""Op announcements through the process group itself.

The leader broadcasts each op as a length-prefixed, protobuf-encoded
``OpDescriptor`` inside a fixed-size uint8 tensor (one broadcast for every
descriptor that fits, a second one for the rest). Protobuf, never pickle:
a descriptor is data, not code.

The slot's header also carries the op's *inline capacity*: how many bytes of
operand data each rank appends to its operand description in the exchange
that follows (0: none; see ``runtime.GenerationRuntime._collective``). The
leader picks it, so every rank sizes that exchange identically.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from collectives.v1 import worker_pb2
from collectives.wire.codec import tensor_memoryview

__all__ = ["announce", "receive", "Announced", "SLOT_BYTES"]

SLOT_BYTES = 1024
_HEAD = struct.Struct("<qq")  # body length, inline capacity + 1 (0: no inline data)
_MAX_BODY = 1 << 20


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
    head = _HEAD.pack(len(body), 0 if inline is None else inline + 1)
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
    """Follower side: waits for the leader's next descriptor; returns it and its inline capacity."""
    slot = torch.empty(SLOT_BYTES, dtype=torch.uint8)
    _broadcast(pg, slot)
    raw = tensor_memoryview(slot)
    length, inline = _HEAD.unpack_from(raw)
    if not 0 <= length <= _MAX_BODY or inline < 0:
        raise ValueError(f"malformed op announcement (length {length}, inline {inline})")
    body = raw[_HEAD.size : _HEAD.size + length].tobytes()
    missing = length - len(body)
    if missing > 0:
        rest = torch.empty(missing, dtype=torch.uint8)
        _broadcast(pg, rest)
        body += tensor_memoryview(rest).tobytes()
    desc = worker_pb2.OpDescriptor()
    desc.ParseFromString(body)
    return desc, (inline - 1 if inline else None)
