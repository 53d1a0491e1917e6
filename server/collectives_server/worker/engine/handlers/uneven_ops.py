"""The handler of an uneven all_to_all (``all_to_all`` with ``split_sizes``).

``desc.uneven.split_sizes[i * size + j]`` rows of dim 0 go from member i to
member j (group-local indices); member j stores the rows every member sent it,
concatenated in member order, under ``out`` (or the input's name), so every
member's result has its own dim 0 (the sum of column j).

On every rank, after the leader's announcement, the tensor pipeline less the
inline path (operands travel by the data collective whatever their size):
  1. every rank all-gathers its operand description and store quota state;
  2. :func:`uneven_validation.decide_uneven`, identical everywhere: fail
     together before any data moves, or go on;
  3. members run ``alltoall_base`` on uint8 views of a private copy and a fresh
     receive buffer (every dtype works), then every rank agrees on every rank's
     outcome and commits only if all succeeded. A follower fences its target
     before the data collective and lifts the fence once committed, as
     ``tensor_ops`` does. A rank lost mid-op breaks the group on every rank
     (``GroupBroken``) and nothing is committed.
"""

from __future__ import annotations

import grpc
import torch

from collectives.errors import CollectiveError, error_for_code
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind, spec
from collectives_server.worker.data.store import Fence
from collectives_server.worker.engine import agreement, validation
from collectives_server.worker.engine.op_context import (
    Announcement,
    GroupBroken,
    GroupEntry,
    OpContext,
    OpResult,
)
from collectives_server.worker.engine.uneven_validation import UnevenPlan, decide_uneven
from collectives_server.worker.kernels import collective_ops as ops
from collectives_server.worker.kernels import op_failures

__all__ = ["run_uneven_all_to_all"]

_NAME = spec(OpKind.ALL_TO_ALL_UNEVEN).name


def run_uneven_all_to_all(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> OpResult | CollectiveError:
    op = spec(desc.kind)
    args = desc.uneven
    group = ctx.groups[desc.group_id]
    member = ctx.rank in group.ranks
    target = args.out or args.name
    if member:
        ctx.expect([target], read=[args.name])
    operand = ctx.operand(args.name) if member else None
    quota = ctx.store.quota_state(target) if member else (0, -1)
    values = validation.info_values(operand, member, quota)
    fence: Fence | None = None
    try:
        exchanged = ctx.call(
            agreement.exchange, ctx.control, ctx.world_size, values, None, 0, ann.pending
        )
        ann.pending = None
        plan = decide_uneven(
            op, args.name, group.ranks, exchanged.infos, list(args.split_sizes), target
        )
        if isinstance(plan, validation.OpError):
            return error_for_code(plan.code, plan.message, reason=plan.reason, ranks=plan.ranks)
        if member and not ctx.is_leader:
            fence = ctx.store.fence(target, 2 * ctx.timeout_s)  # the agreement is the last one
        result, code, message = None, grpc.StatusCode.OK, ""
        if member:
            result, code, message = _member_result(ctx, group, operand, plan)
        error = ctx.agree_and_commit(code, message, {target: result}, op_id=desc.op_id)
        return error or _describe(ctx, desc, group, plan, target)
    finally:
        if fence is not None:
            fence.release()


def _member_result(
    ctx: OpContext, group: GroupEntry, operand: torch.Tensor | None, plan: UnevenPlan
) -> tuple[torch.Tensor | None, grpc.StatusCode, str]:
    """This member's received rows, or the local failure every rank will agree on;
    a transport failure breaks the group instead."""
    assert operand is not None and group.handles is not None  # validation required it
    try:
        if operand.device != ctx.device:
            operand = operand.to(ctx.device)
        index = group.index(ctx.rank)
        try:
            result = ops.all_to_all_uneven(
                group.handles.data, operand, plan.matrix, index, ctx.replaced.empty
            )
        except Exception as exc:
            if op_failures.is_transport_failure(exc):
                raise GroupBroken(op_failures.backend_message(exc)) from exc
            raise
        ctx.count_data_collectives(1)
        return result, grpc.StatusCode.OK, ""
    except GroupBroken:
        raise
    except CollectiveError as exc:
        return None, exc.code, exc.message
    except Exception as exc:  # local to this rank: the op fails, the group stays
        code, message = op_failures.local_failure(exc, _NAME, plan.dtype)
        return None, code, message


def _describe(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    group: GroupEntry,
    plan: UnevenPlan,
    target: str,
) -> OpResult:
    """Every member holds a result of its own shape; the reply describes the first
    member's (the leader's, whenever the leader is a member)."""
    return OpResult(
        desc.op_id,
        ctx.generation,
        target,
        list(group.ranks),
        plan.dtype,
        plan.result_shape(0),
        0.0,
    )
