"""The data collectives themselves, on one process group.

Each function runs on a member of the group with the operand that validation
already checked, works on private buffers (never on the stored tensor), and
returns the tensor this rank should commit, or None. Data-movement ops
(broadcast, gather, all_gather, all_to_all) move raw bytes, so every dtype
works whatever the backend supports; reductions map what gloo lacks onto
what it has:

* bool: computed on uint8 with sum as logical or and product as logical and
  (as NCCL does);
* complex: sum/avg on the real view; product by an all-gather and a local
  product in rank order (identical on every rank);
* reduce and reduce_scatter: an all-reduce, then each rank keeps its part
  (gloo's reduce_scatter does not cover every dtype and op).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from collectives.reduce_ops import ReduceOp

__all__ = [
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "reduce_scatter",
    "all_to_all",
    "barrier",
]

_NATIVE = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
# Reductions of bool tensors, computed on uint8 0/1 values.
_BOOL_AS_UINT8 = {
    ReduceOp.SUM: ReduceOp.MAX,
    ReduceOp.PRODUCT: ReduceOp.MIN,
    ReduceOp.MIN: ReduceOp.MIN,
    ReduceOp.MAX: ReduceOp.MAX,
    ReduceOp.BAND: ReduceOp.BAND,
    ReduceOp.BOR: ReduceOp.BOR,
    ReduceOp.BXOR: ReduceOp.BXOR,
}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (shares storage)."""
    return t.reshape(-1).view(torch.uint8)


def _native_all_reduce(pg: dist.ProcessGroup, buf: torch.Tensor, op: ReduceOp) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = _NATIVE[op]
    pg.allreduce([buf], opts).wait()


def _all_gather_bytes(pg: dist.ProcessGroup, t: torch.Tensor, size: int) -> torch.Tensor:
    """Returns torch.stack of every member's ``t`` (in group order)."""
    out = torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
    if t.numel() == 0:
        return out
    rows = out.reshape(size, -1)
    pg.allgather([[_bytes_of(rows[i]) for i in range(size)]], [_bytes_of(t.contiguous())]).wait()
    return out


def all_reduce(pg: dist.ProcessGroup, t: torch.Tensor, op: ReduceOp, size: int) -> torch.Tensor:
    """The reduction of every member's ``t``, identical on every member."""
    buf = t.detach().clone(memory_format=torch.contiguous_format)
    if buf.numel() == 0:
        return buf
    if buf.dtype == torch.bool:
        as_int = buf.to(torch.uint8)
        _native_all_reduce(pg, as_int, _BOOL_AS_UINT8[op])
        return as_int.bool()
    if buf.dtype.is_complex:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            _native_all_reduce(pg, torch.view_as_real(buf), op)
            return buf
        parts = _all_gather_bytes(pg, buf, size)
        return functools.reduce(operator.mul, parts.unbind(0))
    _native_all_reduce(pg, buf, op)
    return buf


def reduce(pg: dist.ProcessGroup, t: torch.Tensor, op: ReduceOp, size: int) -> torch.Tensor:
    return all_reduce(pg, t, op, size)


def reduce_scatter(
    pg: dist.ProcessGroup, t: torch.Tensor, op: ReduceOp, size: int, index: int
) -> torch.Tensor:
    reduced = all_reduce(pg, t, op, size)
    return (
        reduced.chunk(size, dim=0)[index].clone()
        if reduced.numel()
        else reduced[: t.shape[0] // size]
    )


def broadcast(
    pg: dist.ProcessGroup,
    t: torch.Tensor | None,
    root_index: int,
    index: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    device: torch.device,
) -> torch.Tensor | None:
    """Receivers return the src's tensor; the src returns None (it keeps its own)."""
    if index == root_index:
        assert t is not None
        buf = t.contiguous()
    else:
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
    if buf.numel():
        opts = dist.BroadcastOptions()
        opts.rootRank = root_index
        pg.broadcast([_bytes_of(buf)], opts).wait()
    return None if index == root_index else buf


def all_gather(pg: dist.ProcessGroup, t: torch.Tensor, size: int) -> torch.Tensor:
    return _all_gather_bytes(pg, t, size)


def gather(
    pg: dist.ProcessGroup, t: torch.Tensor, size: int, root_index: int, index: int
) -> torch.Tensor | None:
    """The root returns torch.stack of every member's ``t``; others None."""
    src = t.contiguous()
    if index == root_index:
        out = torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
    if t.numel():
        opts = dist.GatherOptions()
        opts.rootRank = root_index
        if index == root_index:
            rows = out.reshape(size, -1)
            outputs = [[_bytes_of(rows[i]) for i in range(size)]]
        else:
            outputs = []
        pg.gather(outputs, [_bytes_of(src)], opts).wait()
    return out if index == root_index else None


def all_to_all(pg: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    """Chunk j of member i's ``t`` (along dim 0) lands as chunk i of member j."""
    src = t.contiguous()
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    if src.numel():
        pg.alltoall_base(_bytes_of(out), _bytes_of(src), [], [], dist.AllToAllOptions()).wait()
    return out


def barrier(pg: dist.ProcessGroup, device: torch.device) -> None:
    token = torch.ones(1, dtype=torch.int32, device=device)
    _native_all_reduce(pg, token, ReduceOp.SUM)
