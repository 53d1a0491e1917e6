"""The handler of coalesced all_reduce, broadcast and all_gather: several named
tensors in one atomic op.

On every rank, after the leader's announcement:
  1. one all-gather of an int64 matrix per rank (``agreement.exchange_rows``):
     a header row with this rank's store quota state for the whole op (bytes
     held apart from every target, limit), then one operand info per name;
  2. ``validation.decide`` per name with the single-tensor kind's spec (so a
     missing or mismatched name is worded as for ``all_reduce`` & co.), then one
     quota judgement for the op's results together: the first failure fails the
     whole op on every rank before any data moves;
  3. the data in buckets (``coalesced_buckets``: one collective per bucket,
     never one per name), an agreement on every rank's outcome, and only then the
     commit of every result.
Names may differ in dtype and shape. A follower fences every name it will store
before the agreement and lifts the fences once committed, as ``tensor_ops`` does.
Nothing is committed unless every rank succeeded, so a failed op leaves every
tensor as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from collectives.errors import CollectiveError, Reason, error_for_code
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import COALESCED_BASE, OpSpec, spec
from collectives_server.worker.data.store import Fence, quota_message
from collectives_server.worker.engine import agreement, validation
from collectives_server.worker.engine.handlers import coalesced_buckets
from collectives_server.worker.engine.op_context import (
    Announcement,
    GroupBroken,
    GroupEntry,
    OpContext,
    OpResult,
)
from collectives_server.worker.engine.validation import OperandInfo, Plan
from collectives_server.worker.kernels import op_failures

__all__ = ["run_coalesced", "CoalescedResult"]


@dataclass(frozen=True)
class CoalescedResult(OpResult):
    """An OpResult whose ``result_names`` say where each name's result is, in order.
    ``dtype``/``shape`` describe the op's bytes (uint8, for logs and metrics)."""

    result_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Op:
    """What every rank reads from the descriptor."""

    base: OpSpec  # the single-tensor kind: all_reduce, broadcast, all_gather
    names: list[str]
    targets: list[str]  # where each result goes
    reduce_op: ReduceOp
    root: int
    group: GroupEntry

    @classmethod
    def of(cls, ctx: OpContext, desc: worker_pb2.OpDescriptor) -> _Op:
        args = desc.coalesced
        names = list(args.names)
        return cls(
            spec(COALESCED_BASE[spec(desc.kind).kind]),
            names,
            list(args.outs) or names,
            ReduceOp.from_wire(args.op),
            args.root,
            ctx.groups[desc.group_id],
        )


def _quota_state(ctx: OpContext, targets: list[str]) -> tuple[int, int]:
    """(bytes held apart from every target, the limit; -1: none)."""
    held, limit = ctx.store.quota_state(targets[0])
    for name in targets[1:]:
        current = ctx.store.peek(name)
        if current is not None:
            held -= current.numel() * current.element_size()
    return max(held, 0), limit


def _rows(ctx: OpContext, job: _Op, member: bool, operands: list) -> torch.Tensor:
    quota = _quota_state(ctx, job.targets) if member else (0, -1)
    values = [validation.info_values(None, member, quota)]
    values += [validation.info_values(t, member) for t in operands]
    return torch.tensor(values, dtype=torch.int64, device="cpu")


def run_coalesced(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> OpResult | CollectiveError:
    job = _Op.of(ctx, desc)
    member = ctx.rank in job.group.ranks
    if member and job.base.stores_on(ctx.rank, job.root):
        ctx.expect(job.targets, read=job.names)
    operands = [ctx.operand(n) if member else None for n in job.names]
    rows = _rows(ctx, job, member, operands)
    infos = ctx.call(agreement.exchange_rows, ctx.control, ctx.world_size, rows, ann.pending)
    ann.pending = None
    plans = _decide(job, infos)
    if isinstance(plans, CollectiveError):
        return plans
    fences: list[Fence] = []
    try:
        if member and not ctx.is_leader and job.base.stores_on(ctx.rank, job.root):
            fences = [ctx.store.fence(t, 2 * ctx.timeout_s) for t in job.targets]
        return _data_path(ctx, desc, job, operands, plans)
    finally:
        for fence in fences:
            fence.release()


def _decide(job: _Op, infos: list[list[OperandInfo]]) -> list[Plan] | CollectiveError:
    """Every name's plan, or the op's error: the first name that fails, else quota."""
    members = job.group.ranks
    plans: list[Plan] = []
    for i, name in enumerate(job.names):
        by_rank = [rows[i + 1] for rows in infos]
        plan = validation.decide(
            job.base, name, members, by_rank, job.root, job.reduce_op, job.targets[i]
        )
        if isinstance(plan, validation.OpError):
            return error_for_code(
                plan.code, plan.message, reason=plan.reason, ranks=plan.ranks, tensor=name
            )
        plans.append(plan)
    return _check_quota(job, [rows[0] for rows in infos], plans) or plans


def _check_quota(job: _Op, states: list[OperandInfo], plans: list[Plan]) -> CollectiveError | None:
    """Whether every member's store takes all of the op's results together."""
    members, size = job.group.ranks, len(job.group.ranks)
    over = []
    for r in members:
        if states[r].limit < 0:
            continue
        incoming = sum(job.base.result_nbytes(p.dtype, p.shape, size, r, job.root) for p in plans)
        if incoming and states[r].held + incoming > states[r].limit:
            label = job.targets[0] if len(plans) == 1 else f"{len(plans)} results"
            after = states[r].held + incoming
            over.append((r, quota_message(label, incoming, after, states[r].limit)))
    if not over:
        return None
    ranks = tuple(r for r, _ in over)
    return error_for_code(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"failed on rank(s) {', '.join(map(str, ranks))}: {over[0][1]}",
        reason=Reason.QUOTA,
        ranks=ranks,
    )


def _data_path(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    job: _Op,
    operands: list,
    plans: list[Plan],
) -> OpResult | CollectiveError:
    """The buckets' collectives, an agreement on every rank's outcome, then the commit."""
    results: list = []
    code, message = grpc.StatusCode.OK, ""
    if ctx.rank in job.group.ranks:
        try:
            results = _move(ctx, job, operands, plans)
        except GroupBroken:
            raise
        except CollectiveError as exc:
            code, message = exc.code, exc.message
        except Exception as exc:  # local to this rank: the op fails, the group stays
            code, message = op_failures.local_failure(exc, spec(desc.kind).name)
    # The last references to the operands (the caller passed this list): an in-place
    # op's replaced values can then be kept for the next results (ctx.replaced).
    operands.clear()
    committed = dict(zip(job.targets, results, strict=False))  # targets are distinct
    error = ctx.agree_and_commit(code, message, committed, op_id=desc.op_id)
    return error or _describe(ctx, desc, job, plans)


def _move(ctx: OpContext, job: _Op, operands: list, plans: list[Plan]) -> list:
    group = job.group
    assert group.handles is not None
    bucketing = coalesced_buckets.Bucketing(
        pg=group.handles.data,
        operands=operands,
        plans=plans,
        size=len(group.ranks),
        index=group.index(ctx.rank),
        root_index=group.index(job.root) if job.root in group.ranks else 0,
        device=ctx.device,
        alloc=ctx.replaced.empty,
    )
    try:
        results, collectives = coalesced_buckets.move(bucketing, job.base, job.reduce_op)
    except Exception as exc:
        if op_failures.is_transport_failure(exc):
            raise GroupBroken(op_failures.backend_message(exc)) from exc
        raise
    ctx.count_data_collectives(collectives)
    return results


def _describe(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, job: _Op, plans: list[Plan]
) -> CoalescedResult:
    size = len(job.group.ranks)
    nbytes = sum(p.dtype.itemsize * _numel(p.shape) for p in plans if p.dtype is not None)
    # broadcast: every rank holds each result under the src's name
    names = job.names if job.base.name == "broadcast" else job.targets
    return CoalescedResult(
        desc.op_id,
        ctx.generation,
        names[0],
        job.base.result_ranks(job.group.ranks, job.root),
        torch.uint8,
        job.base.result_shape((nbytes,), size),
        0.0,
        tuple(names),
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
