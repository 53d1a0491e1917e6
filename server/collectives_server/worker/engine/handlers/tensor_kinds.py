"""Per kind of tensor collective: how a member computes its result.

Two ways, one entry per kind in :data:`KINDS`:

* ``data(member)``: with a data collective on the group (large operands), via
  :mod:`collectives_server.worker.kernels.collective_ops`;
* ``inline(parts, op, index, root_index)``: from every contributor's operand
  when they travelled inside the operand exchange (small operands), the same
  arithmetic on the same bytes in rank order on every member, so results are
  bit-identical across ranks, like a backend collective's.

Both return the tensor this member stores, or None. The rules about *who*
contributes and stores live in the spec table (``collectives.wire.op_specs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from collectives.reduce_ops import ReduceOp
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine.validation import Plan
from collectives_server.worker.kernels import collective_ops as ops

__all__ = ["Member", "KindOps", "KINDS"]


@dataclass(frozen=True)
class Member:
    """One member's view of a data collective."""

    pg: dist.ProcessGroup
    operand: torch.Tensor | None
    op: ReduceOp
    size: int
    index: int  # this member's position in the group
    root_index: int  # src/dst's position (0 when the kind has none)
    plan: Plan
    device: torch.device
    alloc: ops.Alloc

    @property
    def is_root(self) -> bool:
        return self.index == self.root_index


Parts = Sequence[torch.Tensor | None]


@dataclass(frozen=True)
class KindOps:
    data: Callable[[Member], torch.Tensor | None]
    inline: Callable[[Parts, ReduceOp, int, int], torch.Tensor | None] | None = None


def _operand(m: Member) -> torch.Tensor:
    assert m.operand is not None  # validation required it on every contributor
    return m.operand


def _broadcast(m: Member) -> torch.Tensor | None:
    assert m.plan.dtype is not None
    return ops.broadcast(
        m.pg, m.operand, m.root_index, m.index, m.plan.dtype, m.plan.shape, m.device, m.alloc
    )


def _reduce(m: Member) -> torch.Tensor | None:
    reduced = ops.reduce(m.pg, _operand(m), m.op, m.size, m.alloc, m.root_index)
    return reduced if m.is_root else None


def _barrier(m: Member) -> None:
    ops.barrier(m.pg, m.device)


def _present(parts: Parts) -> list[torch.Tensor]:
    present = [p for p in parts if p is not None]
    assert len(present) == len(parts)
    return present


def _rows(t: torch.Tensor, size: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``size`` equal chunks of ``t`` along dim 0 (a view)."""
    k = t.shape[0] // size
    return t.narrow(0, index * k, k)


def _inline_broadcast(parts: Parts, op: ReduceOp, index: int, root: int) -> torch.Tensor | None:
    src = parts[root]
    assert src is not None
    return None if index == root else src.clone()


def _inline_all_reduce(parts: Parts, op: ReduceOp, index: int, root: int) -> torch.Tensor:
    return ops.fold(_present(parts), op)


def _inline_reduce(parts: Parts, op: ReduceOp, index: int, root: int) -> torch.Tensor | None:
    return ops.fold(_present(parts), op) if index == root else None


def _inline_reduce_scatter(parts: Parts, op: ReduceOp, index: int, root: int) -> torch.Tensor:
    size = len(parts)
    return ops.fold([_rows(p, size, index) for p in _present(parts)], op).contiguous()


def _inline_all_gather(parts: Parts, op: ReduceOp, index: int, root: int) -> torch.Tensor:
    return torch.stack(_present(parts))


def _inline_gather(parts: Parts, op: ReduceOp, index: int, root: int) -> torch.Tensor | None:
    return torch.stack(_present(parts)) if index == root else None


def _inline_all_to_all(parts: Parts, op: ReduceOp, index: int, root: int) -> torch.Tensor:
    size = len(parts)
    return torch.cat([_rows(p, size, index) for p in _present(parts)])


KINDS: dict[OpKind, KindOps] = {
    OpKind.BROADCAST: KindOps(_broadcast, _inline_broadcast),
    OpKind.ALL_REDUCE: KindOps(
        lambda m: ops.all_reduce(m.pg, _operand(m), m.op, m.size, m.alloc), _inline_all_reduce
    ),
    OpKind.REDUCE: KindOps(_reduce, _inline_reduce),
    OpKind.ALL_GATHER: KindOps(
        lambda m: ops.all_gather(m.pg, _operand(m), m.size, m.alloc), _inline_all_gather
    ),
    OpKind.GATHER: KindOps(
        lambda m: ops.gather(m.pg, _operand(m), m.size, m.root_index, m.index, m.alloc),
        _inline_gather,
    ),
    OpKind.REDUCE_SCATTER: KindOps(
        lambda m: ops.reduce_scatter(m.pg, _operand(m), m.op, m.size, m.index, m.alloc),
        _inline_reduce_scatter,
    ),
    OpKind.ALL_TO_ALL: KindOps(
        lambda m: ops.all_to_all(m.pg, _operand(m), m.alloc), _inline_all_to_all
    ),
    OpKind.BARRIER: KindOps(_barrier),
}
