"""Large sums, averages and products reduced over a ring of gloo's point-to-point sends.

gloo reduces only in place, so ``collective_ops`` copies an operand into its
result and all-reduces the copy. A ring all-reduce needs no such copy: each
step receives a chunk straight into the result and folds the operand's own
chunk into it, so the operand is only read (see :func:`all_reduce`, and
docs/perf-log.md "Round two, continued: large reductions read the operand where
it is"). reduce_scatter and reduce run only the ring's first half
(:func:`_own_part`). Every function runs on every member of the group, with
operands validated alike (same dtype and shape), one op at a time per group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from collectives.reduce_ops import ReduceOp

if TYPE_CHECKING:
    from collectives_server.worker.data.buffers import Alloc

__all__ = ["RING_MIN_BYTES", "reducible", "all_reduce", "reduce_scatter", "reduce"]

# Operands of this size and more take the ring; under it the copy costs little and
# gloo's one collective takes fewer messages.
RING_MIN_BYTES = 1 << 20
_FOLD = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVG: torch.Tensor.add_,  # then divided once, where each chunk is complete
    ReduceOp.PRODUCT: torch.Tensor.mul_,
}
_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)
_TAGS = (0x5A11, 0x5A12)  # one op at a time on a group: fixed tags cannot cross


def reducible(t: torch.Tensor, op: ReduceOp) -> bool:
    """Whether the ring takes ``t`` and ``op`` (the caller checks that ``t`` is a
    contiguous CPU tensor: ``collective_ops``)."""
    return (
        op in _FOLD
        and t.dtype in _DTYPES
        and (op is not ReduceOp.AVG or t.dtype.is_floating_point)
        and t.numel() * t.element_size() >= RING_MIN_BYTES
    )


def all_reduce(pg: dist.ProcessGroup, t: torch.Tensor, op: ReduceOp, alloc: Alloc) -> torch.Tensor:
    """``collective_ops.all_reduce`` of large operands without copying ``t`` first.

    gloo reduces only in place, so the general path copies the operand into the
    result and all-reduces the copy: on 2 cores that copy is a fifth of a 64 MiB
    all-reduce. This is the ring all-reduce gloo itself runs, over its
    point-to-point sends, with ``t`` only read: the result is split in ``size``
    chunks; in each of ``size - 1`` steps a member sends a chunk to the next
    member and receives one from the previous straight into the result, then
    folds its own operand's chunk into it (its first send comes from ``t``
    itself); each member then holds one chunk reduced over every member (an
    average divides it there, once), and ``size - 1`` more steps pass the
    reduced chunks round. Every chunk is reduced on one member and copied as
    bytes to the others, so every member holds the same bits. It is faster than
    the copy path for large operands (figures in docs/perf-log.md)."""
    me, size = pg.rank(), pg.size()
    right, left = (me + 1) % size, (me - 1) % size
    out = alloc(t.shape, t.dtype, t.device)
    src = t.reshape(-1).tensor_split(size)
    dst = out.reshape(-1).tensor_split(size)
    for step in range(size - 1):  # reduce-scatter
        give, take = (me - step) % size, (me - step - 1) % size
        received = pg.recv([dst[take]], left, _TAGS[0])
        sent = pg.send([src[give] if step == 0 else dst[give]], right, _TAGS[0])
        received.wait()
        _FOLD[op](dst[take], src[take])
        sent.wait()
    if op is ReduceOp.AVG:
        dst[(me + 1) % size].div_(size)
    for step in range(size - 1):  # all-gather: chunk me + 1 is reduced here
        give, take = (me + 1 - step) % size, (me - step) % size
        received = pg.recv([dst[take]], left, _TAGS[1])
        sent = pg.send([dst[give]], right, _TAGS[1])
        received.wait()
        sent.wait()
    return out


def reduce_scatter(
    pg: dist.ProcessGroup, t: torch.Tensor, op: ReduceOp, alloc: Alloc
) -> torch.Tensor:
    """``collective_ops.reduce_scatter`` as the first half of the ring alone (see
    :func:`_own_part`): this member's part, allocated alone."""
    out = alloc((t.shape[0] // pg.size(), *t.shape[1:]), t.dtype, t.device)
    _own_part(pg, t.reshape(-1).tensor_split(pg.size()), op, out.view(-1))
    return out


def reduce(
    pg: dist.ProcessGroup, t: torch.Tensor, op: ReduceOp, root: int, alloc: Alloc
) -> torch.Tensor | None:
    """``collective_ops.reduce`` as the first half of the ring, then every member's
    reduced part sent to ``root`` (which returns the whole; the others None): the
    parts travel once to the root instead of round the ring to every member."""
    me, size = pg.rank(), pg.size()
    src = t.reshape(-1).tensor_split(size)
    if me != root:
        own = torch.empty(src[me].numel(), dtype=t.dtype, device=t.device)
        _own_part(pg, src, op, own)
        pg.send([own], root, _TAGS[1]).wait()
        return None
    out = alloc(t.shape, t.dtype, t.device)
    parts = out.reshape(-1).tensor_split(size)
    _own_part(pg, src, op, parts[me])
    received = [pg.recv([parts[r]], r, _TAGS[1]) for r in range(size) if r != me]
    for work in received:
        work.wait()
    return out


def _own_part(
    pg: dist.ProcessGroup, src: tuple[torch.Tensor, ...], op: ReduceOp, own: torch.Tensor
) -> None:
    """The reduce-scatter half of :func:`all_reduce`, shifted by one so that the
    part a member completes is its own: ``src`` is the flat operand split in
    ``size`` parts, and ``own`` (flat, this member's part's length) gets this
    member's part reduced over every member. Each
    member sends and receives ``(size - 1) / size`` of the operand once. A step
    receives into a scratch part (two alternate from 4 members on: a step sends
    what the step before received) and the last one into ``own``."""
    me, size = pg.rank(), pg.size()
    right, left = (me + 1) % size, (me - 1) % size
    longest = max(part.numel() for part in src)
    scratch = [
        torch.empty(longest, dtype=own.dtype, device=own.device) for _ in range(min(2, size - 2))
    ]
    previous = None
    for step in range(size - 1):
        give, take = (me - step - 1) % size, (me - step - 2) % size
        into = own if step == size - 2 else scratch[step % 2][: src[take].numel()]
        received = pg.recv([into], left, _TAGS[0])
        sent = pg.send([src[give] if previous is None else previous], right, _TAGS[0])
        received.wait()
        _FOLD[op](into, src[take])
        sent.wait()
        previous = into
    if op is ReduceOp.AVG:
        own.div_(size)
