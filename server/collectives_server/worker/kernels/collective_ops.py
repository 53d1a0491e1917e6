"""The data collectives themselves, on one process group.

Each function runs on a member of the group with the operand that validation
already checked, never writes the stored tensor (results go to private
buffers), and returns the tensor this rank should commit, or None. Data-movement ops
(broadcast, gather, all_gather, all_to_all) move raw bytes, so every dtype
works whatever the backend supports; reductions map what gloo lacks onto
what it has:

* bool: computed on uint8 with sum as logical or and product as logical and
  (as NCCL does);
* complex: sum/avg on the real view; product by an all-gather and a local
  product in rank order (identical on every rank);
* reduce and reduce_scatter: an all-reduce, then each rank keeps its part
  (gloo's reduce_scatter does not cover every dtype and op);
* a sum, average or product of 1 MiB or more of a plain dtype: a ring all-reduce over
  point-to-point sends that reads the operand where it is, instead of copying
  it for gloo's in-place all-reduce (``ring_reductions``); reduce_scatter and
  reduce run only its first half, then each part goes where it belongs.

:func:`fold` reduces operands that travelled inside the operand exchange (see
``handlers/tensor_kinds.py``): the same arithmetic on the same bytes in rank
order on every member, so results are bit-identical across ranks.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from collectives.reduce_ops import ReduceOp
from collectives_server.worker.data.buffers import (
    REUSE_MIN_BYTES,
    Alloc,
    copy_into,
    fresh,
    memmove_ok,
    reusable,
)
from collectives_server.worker.kernels import ring_reductions as ring

__all__ = [
    "broadcast",
    "all_reduce",
    "reduce_buffer",
    "reduce",
    "all_gather",
    "gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_uneven",
    "barrier",
    "fold",
    "private_copy",
    "copy_into",
    "REUSE_MIN_BYTES",
    "fresh",
    "reusable",
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


# Reductions NCCL has no op or type for go through an all-gather and a local fold.
_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
_NCCL_REDUCIBLE = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bfloat16,
    }
)
_FOLD = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}


def private_copy(t: torch.Tensor, alloc: Alloc = fresh) -> torch.Tensor:
    """A contiguous copy of ``t`` that shares nothing with it (see :func:`copy_into`)."""
    t = t.detach()
    if not memmove_ok(t):
        return t.clone(memory_format=torch.contiguous_format)
    out = alloc(t.shape, t.dtype, t.device)
    copy_into(out, t)
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (shares storage)."""
    return t.reshape(-1).view(torch.uint8)


def _native_all_reduce(pg: dist.ProcessGroup, buf: torch.Tensor, op: ReduceOp) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = _NATIVE[op]
    pg.allreduce([buf], opts).wait()


def _all_gather_bytes(
    pg: dist.ProcessGroup, t: torch.Tensor, size: int, alloc: Alloc = fresh
) -> torch.Tensor:
    """Returns torch.stack of every member's ``t`` (in group order)."""
    out = alloc((size, *t.shape), t.dtype, t.device)
    if t.numel() == 0:
        return out
    rows = out.reshape(size, -1)
    pg.allgather([[_bytes_of(rows[i]) for i in range(size)]], [_bytes_of(t.contiguous())]).wait()
    return out


def all_reduce(
    pg: dist.ProcessGroup, t: torch.Tensor, op: ReduceOp, size: int, alloc: Alloc = fresh
) -> torch.Tensor:
    """The reduction of every member's ``t``, identical on every member."""
    if _by_ring(t, op, size):
        return ring.all_reduce(pg, t, op, alloc)
    return reduce_buffer(pg, private_copy(t, alloc), op, size)


def _by_ring(t: torch.Tensor, op: ReduceOp, size: int) -> bool:
    """Whether a reduction of ``t`` runs over ``ring_reductions`` (large, plain, CPU)."""
    return size >= 2 and memmove_ok(t) and ring.reducible(t, op)


def _is_nccl(pg: object) -> bool:
    name = getattr(pg, "name", None)
    return callable(name) and name() == "nccl"


def _nccl_lacks(pg: object, buf: torch.Tensor, op: ReduceOp) -> bool:
    """Whether NCCL cannot run this reduction: a bitwise op, or a dtype it has no type
    for (int16, the unsigned types wider than a byte)."""
    if not _is_nccl(pg):
        return False
    return op in _BITWISE or (buf.dtype not in _NCCL_REDUCIBLE and not buf.dtype.is_complex)


def _fold_gathered(pg: dist.ProcessGroup, buf: torch.Tensor, op: ReduceOp, size: int):
    """Every member's ``buf`` gathered as raw bytes, folded in rank order on each
    member (so the result is bit-identical everywhere)."""
    parts = _all_gather_bytes(pg, buf, size).unbind(0)
    folded = functools.reduce(_FOLD[op], parts)
    return folded / size if op is ReduceOp.AVG else folded


def reduce_buffer(
    pg: dist.ProcessGroup, buf: torch.Tensor, op: ReduceOp, size: int
) -> torch.Tensor:
    """:func:`all_reduce` of a private contiguous buffer, reduced in place where the
    backend can (returns ``buf`` or, for bool and complex product and what NCCL lacks,
    a new tensor)."""
    if buf.numel() == 0:
        return buf
    if buf.dtype != torch.bool and _nccl_lacks(pg, buf, op):
        return _fold_gathered(pg, buf, op, size)
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


def reduce(
    pg: dist.ProcessGroup,
    t: torch.Tensor,
    op: ReduceOp,
    size: int,
    alloc: Alloc = fresh,
    root: int | None = None,
) -> torch.Tensor | None:
    """The reduction on member ``root`` (None there elsewhere); with ``root`` None,
    on every member."""
    if root is not None and _by_ring(t, op, size):
        return ring.reduce(pg, t, op, root, alloc)
    return all_reduce(pg, t, op, size, alloc)


def reduce_scatter(
    pg: dist.ProcessGroup,
    t: torch.Tensor,
    op: ReduceOp,
    size: int,
    index: int,
    alloc: Alloc = fresh,
) -> torch.Tensor:
    """Member ``index``'s part (dim 0 in ``size`` equal parts) of the reduction."""
    if _by_ring(t, op, size):
        return ring.reduce_scatter(pg, t, op, alloc)
    reduced = all_reduce(pg, t, op, size)
    return (
        private_copy(reduced.chunk(size, dim=0)[index], alloc)
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
    alloc: Alloc = fresh,
) -> torch.Tensor | None:
    """Receivers return the src's tensor; the src returns None (it keeps its own)."""
    if index == root_index:
        assert t is not None
        buf = t.contiguous()
    else:
        buf = alloc(tuple(shape), dtype, device)
    if buf.numel():
        opts = dist.BroadcastOptions()
        opts.rootRank = root_index
        pg.broadcast([_bytes_of(buf)], opts).wait()
    return None if index == root_index else buf


def all_gather(
    pg: dist.ProcessGroup, t: torch.Tensor, size: int, alloc: Alloc = fresh
) -> torch.Tensor:
    return _all_gather_bytes(pg, t, size, alloc)


def gather(
    pg: dist.ProcessGroup,
    t: torch.Tensor,
    size: int,
    root_index: int,
    index: int,
    alloc: Alloc = fresh,
) -> torch.Tensor | None:
    """The root returns torch.stack of every member's ``t``; others None."""
    src = t.contiguous()
    if index == root_index:
        out = alloc((size, *t.shape), t.dtype, t.device)
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


def all_to_all(pg: dist.ProcessGroup, t: torch.Tensor, alloc: Alloc = fresh) -> torch.Tensor:
    """Chunk j of member i's ``t`` (along dim 0) lands as chunk i of member j."""
    src = t.contiguous()
    out = alloc(src.shape, src.dtype, src.device)
    if src.numel():
        pg.alltoall_base(_bytes_of(out), _bytes_of(src), [], [], dist.AllToAllOptions()).wait()
    return out


def all_to_all_uneven(
    pg: dist.ProcessGroup,
    t: torch.Tensor,
    matrix: Sequence[Sequence[int]],
    index: int,
    alloc: Alloc = fresh,
) -> torch.Tensor:
    """``matrix[i][j]`` rows of dim 0 go from member i to member j; this member
    (``index``) returns the rows every member sent it, concatenated in member order.

    Every member calls this with the same matrix (validated: row ``index`` sums to
    ``t.shape[0]``, rows of the same dtype and size everywhere), so all of them take
    the same branch: nothing to move anywhere means no collective on any member."""
    src = t.contiguous()
    recv = [row[index] for row in matrix]
    out = alloc((sum(recv), *src.shape[1:]), src.dtype, src.device)
    row_bytes = src.element_size()
    for d in src.shape[1:]:
        row_bytes *= d
    if row_bytes and any(any(row) for row in matrix):
        pg.alltoall_base(
            _bytes_of(out),
            _bytes_of(src),
            [n * row_bytes for n in recv],
            [n * row_bytes for n in matrix[index]],
            dist.AllToAllOptions(),
        ).wait()
    return out


def barrier(pg: dist.ProcessGroup, device: torch.device) -> None:
    token = torch.ones(1, dtype=torch.int32, device=device)
    _native_all_reduce(pg, token, ReduceOp.SUM)


# ------------------------------------------------------------ inline results
_BOOL_FOLD = {
    ReduceOp.SUM: torch.logical_or,
    ReduceOp.MAX: torch.logical_or,
    ReduceOp.BOR: torch.logical_or,
    ReduceOp.PRODUCT: torch.logical_and,
    ReduceOp.MIN: torch.logical_and,
    ReduceOp.BAND: torch.logical_and,
    ReduceOp.BXOR: torch.logical_xor,
}
_WIDENED = (torch.float16, torch.bfloat16)


def fold(parts: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction of ``parts`` in order, elementwise (deterministic on every rank).

    Half-precision values are reduced in float32 and rounded once at the end."""
    dtype = parts[0].dtype
    if dtype == torch.bool:
        fold = _BOOL_FOLD[op]
        acc = parts[0].clone()
        for p in parts[1:]:
            acc = fold(acc, p)
        return acc
    wide = dtype in _WIDENED
    acc = parts[0].to(torch.float32) if wide else parts[0].clone()
    for p in parts[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc.add_(p)
        elif op is ReduceOp.PRODUCT:
            acc.mul_(p)
        elif op is ReduceOp.MIN:
            torch.minimum(acc, p, out=acc)
        elif op is ReduceOp.MAX:
            torch.maximum(acc, p, out=acc)
        elif op is ReduceOp.BAND:
            acc.bitwise_and_(p)
        elif op is ReduceOp.BOR:
            acc.bitwise_or_(p)
        elif op is ReduceOp.BXOR:
            acc.bitwise_xor_(p)
        else:  # validation refuses every other op before data moves
            raise ValueError(f"reduce op {op} has no inline form")
    if op is ReduceOp.AVG:
        acc.div_(len(parts))
    return acc.to(dtype) if wide else acc
