"""The handler of ``exchange``: ``send`` (one pair) and ``batch_isend_irecv`` (several).

Every pair's dst stores what its src held *before* the op, so a ring shift
works even when every rank is both a src and a dst of the same name. On every
rank, after the leader's announcement:
  1. every rank all-gathers its operand description (a src's tensor; others
     none) and its store's quota state (what a dst needs to judge its result);
  2. :func:`decide_exchange`, identical everywhere: the operand missing on
     every src (NOT_FOUND) or some (FAILED_PRECONDITION), a dst over its quota
     (RESOURCE_EXHAUSTED): every rank fails together before data moves;
  3. gloo point to point on the group's ranks: every src sends its stored
     tensor's raw bytes to each of its dsts, every dst receives into a fresh
     buffer of its src's dtype and shape (sources may differ), all issued and
     then waited; raw bytes, so every dtype works;
  4. an agreement on every rank's outcome, then each dst commits (nothing in
     place: a failure or a lost rank leaves every stored value as it was).
A follower dst fences its target before the agreement and lifts the fence once
committed, like the tensor ops (``store.Fence``).
"""

from __future__ import annotations

import grpc
import torch
import torch.distributed as dist

from collectives.errors import CollectiveError, Reason, error_for_code
from collectives.v1 import worker_pb2
from collectives_server.worker.data.store import Fence, quota_message
from collectives_server.worker.engine import agreement, validation
from collectives_server.worker.engine.op_context import (
    Announcement,
    GroupBroken,
    GroupEntry,
    OpContext,
    OpResult,
)
from collectives_server.worker.engine.validation import PRESENT, OperandInfo, OpError, Plan
from collectives_server.worker.kernels import op_failures

__all__ = ["run_exchange", "decide_exchange"]

Pairs = list[tuple[int, int]]
_CPU = torch.device("cpu")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def decide_exchange(
    name: str, target: str, pairs: Pairs, infos: list[OperandInfo]
) -> Plan | OpError:
    """The verdict every rank reaches from the exchanged infos (indexed by global rank).

    The plan names the sources' dtype and shape when they all agree (else None, ())."""
    srcs = sorted({s for s, _ in pairs})
    missing = [s for s in srcs if infos[s].state != PRESENT]
    if missing == srcs:
        return OpError(
            grpc.StatusCode.NOT_FOUND,
            f"tensor {name!r} not found on any src rank ({_ranks(srcs)}); put it on every src "
            "before the exchange",
            reason=Reason.OPERAND_MISSING,
            ranks=tuple(srcs),
        )
    if missing:
        present = [s for s in srcs if s not in missing]
        return OpError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"tensor {name!r} is missing on src rank(s) {_ranks(missing)} but present on src "
            f"rank(s) {_ranks(present)}; exchange needs it on every src",
            reason=Reason.OPERAND_MISSING,
            ranks=tuple(missing),
        )
    over = []
    for s, d in pairs:
        held, limit, incoming = infos[d].held, infos[d].limit, infos[s].nbytes
        if limit >= 0 and incoming and held + incoming > limit:
            over.append((d, quota_message(target, incoming, held + incoming, limit)))
    if over:
        over.sort()
        return OpError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"failed on rank(s) {_ranks([d for d, _ in over])}: {over[0][1]}",
            reason=Reason.QUOTA,
            ranks=tuple(d for d, _ in over),
        )
    described = {(infos[s].dtype, infos[s].shape) for s in srcs}
    if len(described) == 1:
        ((dtype, shape),) = described
        return Plan(dtype, shape)
    return Plan(None, ())


def run_exchange(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> OpResult | CollectiveError:
    args = desc.exchange
    group = ctx.groups[desc.group_id]
    pairs: Pairs = list(zip(args.srcs, args.dsts, strict=True))
    target = args.out or args.name
    receives = any(d == ctx.rank for _, d in pairs)
    operand = ctx.operand(args.name) if any(s == ctx.rank for s, _ in pairs) else None
    quota = ctx.store.quota_state(target) if receives else (0, -1)
    values = validation.info_values(operand, ctx.rank in group.ranks, quota)
    fence: Fence | None = None
    try:
        exchanged = ctx.call(
            agreement.exchange, ctx.control, ctx.world_size, values, None, 0, ann.pending
        )
        ann.pending = None
        plan = decide_exchange(args.name, target, pairs, exchanged.infos)
        if isinstance(plan, OpError):
            return error_for_code(plan.code, plan.message, reason=plan.reason, ranks=plan.ranks)
        if receives and not ctx.is_leader:
            fence = ctx.store.fence(target, 2 * ctx.timeout_s)  # the agreement is the last one
        result, code, message = _move(ctx, desc, group, pairs, exchanged.infos, operand)
        failures = ctx.call(agreement.agree, ctx.control, ctx.world_size, code, message)
        if failures:
            return ctx.fail_all(failures)
        # Every rank agreed: commit, even if the generation is being retired right now.
        if result is not None:
            old = ctx.store.replace(target, result)
            if old is not None:
                ctx.spares.offer(old)
        dsts = sorted(d for _, d in pairs)
        return OpResult(desc.op_id, ctx.generation, target, dsts, plan.dtype, plan.shape, 0.0)
    finally:
        if fence is not None:
            fence.release()


def _move(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    group: GroupEntry,
    pairs: Pairs,
    infos: list[OperandInfo],
    operand: torch.Tensor | None,
) -> tuple[torch.Tensor | None, grpc.StatusCode, str]:
    """This rank's sends and receive: (its result, the outcome to agree on).

    A transport failure is :class:`GroupBroken`; anything else fails the op here."""
    if all(ctx.rank not in pair for pair in pairs):
        return None, grpc.StatusCode.OK, ""
    try:
        result = _send_and_receive(ctx, desc, group, pairs, infos, operand)
        ctx.count_data_collectives(1)
        return result, grpc.StatusCode.OK, ""
    except GroupBroken:
        raise
    except Exception as exc:
        if op_failures.is_transport_failure(exc):
            raise GroupBroken(op_failures.backend_message(exc)) from exc
        dtype = operand.dtype if operand is not None else None
        code, message = op_failures.local_failure(exc, "exchange", dtype)
        return None, code, message


def _data_group(ctx: OpContext, group: GroupEntry) -> dist.ProcessGroup:
    """The group's gloo group: the data group on CPU workers; on CUDA workers the data
    group is NCCL, so point to point goes through the (gloo) control group on host
    copies."""
    assert group.handles is not None
    return group.handles.data if ctx.device.type == "cpu" else group.handles.control


def _send_and_receive(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    group: GroupEntry,
    pairs: Pairs,
    infos: list[OperandInfo],
    operand: torch.Tensor | None,
) -> torch.Tensor | None:
    pg = _data_group(ctx, group)
    tag = desc.op_id & 0x7FFFFFFF
    src = next((s for s, d in pairs if d == ctx.rank), None)
    result: torch.Tensor | None = None
    if src is not None:  # allocated before anything is issued
        info = infos[src]
        assert info.dtype is not None
        result = ctx.spares.empty(info.shape, info.dtype, _CPU)
    works = []
    if operand is not None and operand.numel():
        wire = operand.detach().to(_CPU).contiguous().reshape(-1).view(torch.uint8)
        for s, d in pairs:
            if s == ctx.rank:
                works.append(pg.send([wire], group.index(d), tag))
    if src is not None and result is not None and result.numel():
        works.append(pg.recv([result.reshape(-1).view(torch.uint8)], group.index(src), tag))
    for work in works:
        work.wait()
    if result is not None and result.device != ctx.device:
        result = result.to(ctx.device)
    return result
