"""Op announcements through the process group itself.

The leader broadcasts each op as a length-prefixed, protobuf-encoded
``OpDescriptor`` inside a fixed-size uint8 tensor (one broadcast for every
descriptor that fits, a second one for the rest). Protobuf, never pickle:
a descriptor is data, not code.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from collectives.codec import tensor_memoryview
from collectives.v1 import worker_pb2

__all__ = ["announce", "receive", "SLOT_BYTES"]

SLOT_BYTES = 4096
_LEN = struct.Struct("<q")


def _broadcast(pg: dist.ProcessGroup, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


def announce(pg: dist.ProcessGroup, desc: worker_pb2.OpDescriptor) -> None:
    """Leader side: sends ``desc`` to every rank of ``pg`` (the leader is rank 0)."""
    body = desc.SerializeToString()
    slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
    head = _LEN.pack(len(body)) + body[: SLOT_BYTES - _LEN.size]
    slot[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    _broadcast(pg, slot)
    rest = body[SLOT_BYTES - _LEN.size :]
    if rest:
        _broadcast(pg, torch.frombuffer(bytearray(rest), dtype=torch.uint8))


def receive(pg: dist.ProcessGroup) -> worker_pb2.OpDescriptor:
    """Follower side: waits for the leader's next descriptor."""
    slot = torch.empty(SLOT_BYTES, dtype=torch.uint8)
    _broadcast(pg, slot)
    raw = _to_bytes(slot)
    (length,) = _LEN.unpack_from(raw)
    body = raw[_LEN.size : _LEN.size + length]
    missing = length - len(body)
    if missing > 0:
        rest = torch.empty(missing, dtype=torch.uint8)
        _broadcast(pg, rest)
        body += _to_bytes(rest)
    desc = worker_pb2.OpDescriptor()
    desc.ParseFromString(body)
    return desc


def _to_bytes(t: torch.Tensor) -> bytes:
    return tensor_memoryview(t.contiguous()).tobytes()
