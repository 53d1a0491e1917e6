"""The data of a coalesced op: its operands packed into buckets, one collective each.

Like DDP's gradient buckets: operands are grouped into buckets of at most
``BUCKET_BYTES`` (an operand larger than that gets a bucket of its own), each
bucket flattened into one private buffer, moved by one data collective, and
unflattened into one private result tensor per name. Reductions need one
dtype per bucket (operands are grouped by dtype, in the order each dtype first
appears, then split by size), and they map bool, complex and AVG onto what the
backend has exactly as a single ``all_reduce`` does
(``collective_ops.reduce_buffer`` on the flat buffer). Broadcast and all_gather
move raw bytes, so their buckets mix dtypes: one collective per
``BUCKET_BYTES`` of data, whatever the dtypes.

A bucket of one operand skips the flattening copy: it runs the single-tensor
collective on the operand itself, so a coalesced op of large tensors moves
them as their own ops would.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from collectives.reduce_ops import ReduceOp
from collectives.wire.op_specs import Operand, OpSpec
from collectives_server.worker.engine.validation import Plan
from collectives_server.worker.kernels import collective_ops
from collectives_server.worker.kernels.collective_ops import Alloc, private_copy

__all__ = ["BUCKET_BYTES", "Bucketing", "buckets", "move"]

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size (model_ops' default too)


@dataclass(frozen=True)
class Bucketing:
    """What this member moves: its operands (None where it contributes none), every
    name's plan, and its place in the group."""

    pg: dist.ProcessGroup
    operands: Sequence[torch.Tensor | None]
    plans: Sequence[Plan]
    size: int
    index: int
    root_index: int
    device: torch.device
    alloc: Alloc


def _nbytes(plan: Plan) -> int:
    assert plan.dtype is not None
    n = plan.dtype.itemsize
    for d in plan.shape:
        n *= d
    return n


def buckets(plans: Sequence[Plan], by_dtype: bool, limit: int = 0) -> list[list[int]]:
    """Indices (into ``plans``) per bucket: grouped by dtype (in the order each first
    appears) when ``by_dtype``, in the given order within a group, split so that a
    bucket holds at most ``limit`` bytes (default ``BUCKET_BYTES``) unless it holds
    one operand."""
    limit = limit or BUCKET_BYTES
    groups: dict[object, list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan.dtype if by_dtype else None, []).append(i)
    result: list[list[int]] = []
    for indices in groups.values():
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = _nbytes(plans[i])
            if current and size + nbytes > limit:
                result.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            result.append(current)
    return result


def _on_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    assert t is not None
    return (t if t.device == device else t.to(device)).contiguous()


def _copy_bytes(dst: torch.Tensor, dst_at: int, src: torch.Tensor, src_at: int, n: int) -> None:
    """Copies ``n`` bytes between two contiguous tensors' memory, at byte offsets: one
    memmove on the CPU (a bucket holds hundreds of small tensors; torch's copy costs
    several times more per call, and see ``collective_ops.copy_into``)."""
    if not n:
        return
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr() + dst_at, src.data_ptr() + src_at, n)
        return
    to = dst.reshape(-1).view(torch.uint8)[dst_at : dst_at + n]
    to.copy_(src.reshape(-1).view(torch.uint8)[src_at : src_at + n])


def _pack(b: Bucketing, indices: list[int], dtype: torch.dtype) -> torch.Tensor:
    """This member's operands of one bucket back to back in one flat buffer of ``dtype``."""
    sizes = [_nbytes(b.plans[i]) for i in indices]
    flat = b.alloc((sum(sizes) // dtype.itemsize,), dtype, b.device)
    at = 0
    for i, n in zip(indices, sizes, strict=True):
        _copy_bytes(flat, at, _on_device(b.operands[i], b.device), 0, n)
        at += n
    return flat


def _unpack(b: Bucketing, indices: list[int], flat: torch.Tensor, rows: int = 0) -> list:
    """Each name's private result from its bytes in ``flat`` (packed as :func:`_pack`
    does); ``rows``: ``flat`` holds one packed row per member, each result stacks them."""
    sizes = [_nbytes(b.plans[i]) for i in indices]
    stride = sum(sizes)
    results: list[torch.Tensor | None] = []
    at = 0
    for i, n in zip(indices, sizes, strict=True):
        plan = b.plans[i]
        assert plan.dtype is not None
        shape = (rows, *plan.shape) if rows else plan.shape
        # Only results of a MiB or more are kept for reuse; below, skip the look-up.
        big = n * max(rows, 1) >= collective_ops.REUSE_MIN_BYTES
        alloc = b.alloc if big else collective_ops.fresh
        out = alloc(shape, plan.dtype, b.device)
        for r in range(max(rows, 1)):
            _copy_bytes(out, r * n, flat, r * stride + at, n)
        results.append(out)
        at += n
    return results


def _reduce(b: Bucketing, indices: list[int], op: ReduceOp) -> list[torch.Tensor | None]:
    """One all-reduce of a one-dtype bucket; each name's reduced value."""
    if len(indices) == 1:
        buf = private_copy(_on_device(b.operands[indices[0]], b.device), b.alloc)
        return [collective_ops.reduce_buffer(b.pg, buf, op, b.size)]
    dtype = b.plans[indices[0]].dtype
    assert dtype is not None
    reduced = collective_ops.reduce_buffer(b.pg, _pack(b, indices, dtype), op, b.size)
    return _unpack(b, indices, reduced.contiguous())


def _broadcast(b: Bucketing, indices: list[int]) -> list[torch.Tensor | None]:
    """One broadcast from the root of a bucket; receivers' values (the root keeps its own)."""
    root = b.index == b.root_index
    if len(indices) == 1:
        plan = b.plans[indices[0]]
        assert plan.dtype is not None
        t = _on_device(b.operands[indices[0]], b.device) if root else None
        got = collective_ops.broadcast(
            b.pg, t, b.root_index, b.index, plan.dtype, plan.shape, b.device, b.alloc
        )
        return [got]
    total = sum(_nbytes(b.plans[i]) for i in indices)
    flat = _pack(b, indices, torch.uint8) if root else None
    got = collective_ops.broadcast(
        b.pg, flat, b.root_index, b.index, torch.uint8, (total,), b.device, b.alloc
    )
    return [None] * len(indices) if got is None else _unpack(b, indices, got)


def _all_gather(b: Bucketing, indices: list[int]) -> list[torch.Tensor | None]:
    """One all-gather of a bucket; each name's parts stacked in group order."""
    if len(indices) == 1:
        t = _on_device(b.operands[indices[0]], b.device)
        return [collective_ops.all_gather(b.pg, t, b.size, b.alloc)]
    packed = _pack(b, indices, torch.uint8)
    gathered = collective_ops.all_gather(b.pg, packed, b.size, b.alloc)
    return _unpack(b, indices, gathered, rows=b.size)


Mover = Callable[[Bucketing, list[int]], list[torch.Tensor | None]]


def move(b: Bucketing, base: OpSpec, op: ReduceOp, limit: int = 0) -> tuple[list, int]:
    """Moves every operand of a coalesced op whose single-tensor kind is ``base``
    (all_reduce, broadcast or all_gather, told apart by their specs); returns (this
    member's result per name, None where it stores nothing; the number of data
    collectives it ran)."""
    mover: Mover
    if base.reducing:
        mover = lambda bucketing, indices: _reduce(bucketing, indices, op)  # noqa: E731
    elif base.operand is Operand.ROOT:
        mover = _broadcast
    else:
        mover = _all_gather
    plan = buckets(b.plans, by_dtype=base.reducing, limit=limit)
    results: list[torch.Tensor | None] = [None] * len(b.plans)
    for indices in plan:
        for i, value in zip(indices, mover(b, indices), strict=True):
            results[i] = value
    return results, len(plan)
