"""The handler of every collective on a named tensor (and of barrier).

On every rank, after the leader's announcement:
  1. every rank all-gathers its operand description and store quota state,
     and, when the leader saw a small operand (the announcement's inline
     capacity), the operand's bytes with it;
  2. :func:`validation.decide`, identical everywhere: fail together (missing,
     mismatched or over-quota anywhere), or go on;
  3. small operands: every member computes its result from the exchanged
     bytes (``tensor_kinds``) and commits: two control rounds per op in all;
     otherwise: the data collective on private buffers, an agreement on every
     rank's outcome, and a commit only if every rank succeeded.
A follower fences the name its result goes to before its last exchange of the
op and lifts the fence once committed (``store.Fence``), so a client reading
any rank right after the leader answered sees the result; no barrier per op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import torch

from collectives.errors import CollectiveError, error_for_code
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import Operand, OpKind, Stores, spec
from collectives_server.worker.data.store import Fence
from collectives_server.worker.engine import agreement, validation
from collectives_server.worker.engine.handlers.tensor_kinds import KINDS, Member
from collectives_server.worker.engine.op_context import (
    Announcement,
    GroupBroken,
    GroupEntry,
    OpContext,
    OpResult,
)
from collectives_server.worker.kernels import op_failures

__all__ = [
    "run_tensor_op",
    "prepare",
    "finish",
    "Prepared",
    "inline_capacity",
    "INLINE_MAX_BYTES",
    "INLINE_MAX_TOTAL_BYTES",
]

log = logging.getLogger(__name__)

# Operands up to this size (per rank, and world x this in all) travel inside the
# operand exchange instead of a data collective of their own.
INLINE_MAX_BYTES = 64 * 1024
INLINE_MAX_TOTAL_BYTES = 1024 * 1024


def inline_capacity(ctx: OpContext, desc: worker_pb2.OpDescriptor) -> int | None:
    """Leader: the bytes of operand every rank appends to its info (None: no inline data).

    Sized from the leader's own operand, so it is only a guess for the others;
    every rank checks that each contributor's operand fitted (from the infos)
    and otherwise runs the data collective, all taking the same branch. On an
    accelerator too: a small operand is copied to the host for the exchange
    (``agreement``) and the result back to the device, which costs less than a
    collective launch of its own (and makes the op claimable and fusable)."""
    op = spec(desc.kind)
    if not op.is_collective:
        return None
    if desc.kind == OpKind.BARRIER:
        return 0  # the exchange itself is the barrier
    group = ctx.groups.get(desc.group_id)
    if not op.inline or group is None or ctx.rank not in group.ranks:
        return None
    t = ctx.store.peek(desc.tensor.name)
    if t is None:
        return None
    nbytes = t.numel() * t.element_size()
    if nbytes > INLINE_MAX_BYTES or nbytes * ctx.world_size > INLINE_MAX_TOTAL_BYTES:
        return None
    return -(-nbytes // 16) * 16  # rows stay 16-byte aligned for every dtype


@dataclass
class Prepared:
    """One rank's part of a tensor op before its exchange: what it contributes, where
    its result goes, and the fence it holds (shared by the single and the fused path)."""

    desc: worker_pb2.OpDescriptor
    inline: int | None
    group: GroupEntry
    member: bool
    target: str
    stores_here: bool
    operand: torch.Tensor | None
    values: list[int]
    fence: Fence | None = None

    def release(self) -> None:
        if self.fence is not None:
            self.fence.release()
            self.fence = None


def prepare(ctx: OpContext, desc: worker_pb2.OpDescriptor, inline: int | None) -> Prepared:
    """This rank's operand info (and, with inline data, the fence on its target: the
    exchange is then the op's last one)."""
    op = spec(desc.kind)
    args = desc.tensor
    group = ctx.groups[desc.group_id]
    member = ctx.rank in group.ranks
    target = args.out or args.name
    stores_here = member and op.stores is not Stores.NONE and not ctx.is_leader
    reads = member and op.operand is not Operand.NONE
    if member and op.stores is not Stores.NONE:
        ctx.expect([target], read=[args.name] if reads else [])
    operand = ctx.operand(args.name) if reads else None
    quota = ctx.store.quota_state(target) if member else (0, -1)
    values = validation.info_values(operand, member, quota)
    prepared = Prepared(desc, inline, group, member, target, stores_here, operand, values)
    if inline is not None and stores_here:
        prepared.fence = ctx.store.fence(target, 2 * ctx.timeout_s)
    return prepared


def run_tensor_op(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> OpResult | CollectiveError:
    prepared = prepare(ctx, desc, ann.inline)
    try:
        exchanged = ctx.call(
            agreement.exchange,
            ctx.control,
            ctx.world_size,
            prepared.values,
            prepared.operand,
            ann.inline or 0,
            ann.pending,
        )
        ann.pending = None
        return finish(ctx, prepared, exchanged)
    finally:
        prepared.release()


def finish(
    ctx: OpContext, prepared: Prepared, exchanged: agreement.Exchanged
) -> OpResult | CollectiveError:
    """The rest of the op after its exchange: decide, then inline or the data path."""
    desc = prepared.desc
    op = spec(desc.kind)
    args = desc.tensor
    group, target = prepared.group, prepared.target
    reduce_op = ReduceOp.from_wire(args.op)
    members = group.ranks
    plan = validation.decide(op, args.name, members, exchanged.infos, args.root, reduce_op, target)
    if isinstance(plan, validation.OpError):
        return error_for_code(plan.code, plan.message, reason=plan.reason, ranks=plan.ranks)
    contributors = op.contributors(members, args.root)
    inline = prepared.inline
    if inline is not None and all(exchanged.infos[r].nbytes <= inline for r in contributors):
        if prepared.member and contributors:
            result = _inline_member(ctx, desc, group, exchanged, contributors, reduce_op)
            ctx.count_data_collectives(1)
            ctx.commit({target: result}, desc.op_id)  # every rank computed it alike
        return _describe(ctx, desc, group, plan, target)
    if prepared.fence is None and prepared.stores_here:
        prepared.fence = ctx.store.fence(target, 2 * ctx.timeout_s)  # the agreement is last
    # The data path owns the operand from here: once the collective read it, no
    # reference is left, so an in-place op's replaced value can be a spare buffer.
    held, prepared.operand = [prepared.operand], None
    return _data_path(ctx, desc, group, held, plan, reduce_op, target)


def _data_path(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    group: GroupEntry,
    held: list[torch.Tensor | None],
    plan: validation.Plan,
    reduce_op: ReduceOp,
    target: str,
) -> OpResult | CollectiveError:
    """The data collective, an agreement on every rank's outcome, then the commit.

    ``held`` is a one-item list holding the operand, emptied once the collective
    ran: the commit then finds no reference to the value it replaces but its own,
    and keeps that memory for the next result (``replaced_memory.py``)."""
    result: torch.Tensor | None = None
    code, message = grpc.StatusCode.OK, ""
    dtype = held[0].dtype if held[0] is not None else None
    if ctx.rank in group.ranks:
        try:
            result = _run_member(ctx, desc, group, held.pop(), plan, reduce_op)
            ctx.count_data_collectives(1)
        except GroupBroken:
            raise
        except CollectiveError as exc:
            code, message = exc.code, exc.message
        except Exception as exc:  # local to this rank: the op fails, the group stays
            code, message = op_failures.local_failure(exc, spec(desc.kind).name, dtype)
    held.clear()
    error = ctx.agree_and_commit(code, message, {target: result}, op_id=desc.op_id)
    return error or _describe(ctx, desc, group, plan, target)


def _root_index(group: GroupEntry, root: int) -> int:
    return group.index(root) if root in group.ranks else 0


def _inline_member(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    group: GroupEntry,
    exchanged: agreement.Exchanged,
    contributors: list[int],
    reduce_op: ReduceOp,
) -> torch.Tensor | None:
    """This member's result from the operands that travelled inline.

    Pure arithmetic on bytes every member received identically (validation
    already passed everywhere), so it cannot fail on one rank only; if it
    ever raised, this rank leaves the group rather than diverge silently."""
    parts: list[torch.Tensor | None] = [None] * len(group.ranks)
    for r in contributors:
        parts[group.index(r)] = exchanged.payload(r, exchanged.infos[r])
    inline = KINDS[OpKind(desc.kind)].inline
    assert inline is not None
    try:
        result = inline(
            parts, reduce_op, group.index(ctx.rank), _root_index(group, desc.tensor.root)
        )
    except Exception as exc:
        log.exception("op %d: computing the inline result failed", desc.op_id)
        raise GroupBroken(f"computing the result of op {desc.op_id} failed: {exc}") from exc
    if result is not None and result.device != ctx.device:
        result = result.to(ctx.device)
    return result


def _run_member(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    group: GroupEntry,
    operand: torch.Tensor | None,
    plan: validation.Plan,
    reduce_op: ReduceOp,
) -> torch.Tensor | None:
    assert group.handles is not None
    if operand is not None and operand.device != ctx.device:
        operand = operand.to(ctx.device)
    member = Member(
        pg=group.handles.data,
        operand=operand,
        op=reduce_op,
        size=len(group.ranks),
        index=group.index(ctx.rank),
        root_index=_root_index(group, desc.tensor.root),
        plan=plan,
        device=ctx.device,
        alloc=ctx.replaced.empty,
    )
    try:
        return KINDS[OpKind(desc.kind)].data(member)
    except Exception as exc:
        if op_failures.is_transport_failure(exc):
            raise GroupBroken(op_failures.backend_message(exc)) from exc
        raise


def _describe(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    group: GroupEntry,
    plan: validation.Plan,
    target: str,
) -> OpResult:
    op = spec(desc.kind)
    args = desc.tensor
    if op.operand is Operand.NONE:
        result_name = ""
    elif op.stores is Stores.NOT_ROOT:
        result_name = args.name  # broadcast: every rank holds it under the src's name
    else:
        result_name = target
    return OpResult(
        desc.op_id,
        ctx.generation,
        result_name,
        op.result_ranks(group.ranks, args.root),
        plan.dtype,
        op.result_shape(plan.shape, len(group.ranks)),
        0.0,
    )
