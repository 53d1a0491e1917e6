"""The handler of ``exchange``: ``send`` (one pair) and ``batch_isend_irecv`` (several).

Every pair's dst stores what its src held *before* the op, so a ring shift
works even when every rank is both a src and a dst of the same name. On every
rank, after the leader's announcement:
  1. every rank all-gathers its operand description (a src's tensor; others
     none) and its store's quota state (what a dst needs to judge its result);
  2. :func:`decide_exchange`, identical everywhere: the operand missing on
     every src (NOT_FOUND) or some (FAILED_PRECONDITION), a dst over its quota
     (RESOURCE_EXHAUSTED): every rank fails together before data moves;
  3. point to point on the group's ranks: every src sends its stored tensor's
     raw bytes to each of its dsts, every dst receives into a fresh buffer of
     its src's dtype and shape (sources may differ), all issued and then
     waited; raw bytes, so every dtype works. On a CPU worker this is the gloo
     data group. On an accelerator (NCCL) group, an exchange whose largest
     operand reaches :data:`DEVICE_P2P_MIN_BYTES` moves on the device, every
     rank's sends and receive in one NCCL group call (``batch_isend_irecv``'s
     coalescing: a ring shift of blocking sends would deadlock on NCCL's
     stream, and a coalesced launch uses the group's communicator instead of
     building one per pair); a smaller one crosses the host on the gloo
     control group, which costs less than an NCCL launch and its completion
     poll. Every rank decides the road from the exchanged sizes, so both ends of
     every pair take the same one;
  4. an agreement on every rank's outcome, then each dst commits (nothing in
     place: a failure or a lost rank leaves every stored value as it was).
A follower dst fences its target before the agreement and lifts the fence once
committed, like the tensor ops (``store.Fence``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import torch

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

__all__ = ["DEVICE_P2P_MIN_BYTES", "run_exchange", "decide_exchange"]

Pairs = list[tuple[int, int]]
_CPU = torch.device("cpu")
# On an accelerator group, exchanges whose largest operand has at least this many
# bytes move on the device (NCCL); smaller ones cross the host on the control group.
DEVICE_P2P_MIN_BYTES = 64 << 10


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
    sends = any(s == ctx.rank for s, _ in pairs)
    if receives:
        ctx.expect([target], read=[args.name] if sends else [])
    operand = ctx.operand(args.name) if sends else None
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
        error = ctx.agree_and_commit(code, message, {target: result}, op_id=desc.op_id)
        if error is not None:
            return error
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


def _on_accelerator(group: GroupEntry) -> bool:
    """Whether the group's data group is an accelerator's (NCCL), not gloo."""
    assert group.handles is not None
    name = getattr(group.handles.data, "name", None)
    return callable(name) and name() != "gloo"


def _on_device(group: GroupEntry, pairs: Pairs, infos: list[OperandInfo]) -> bool:
    """Whether this exchange moves on the accelerator group: the same answer on every
    rank (it reads only the exchanged infos and the group's backend)."""
    largest = max((infos[s].nbytes for s, _ in pairs), default=0)
    return _on_accelerator(group) and largest >= DEVICE_P2P_MIN_BYTES


def _send_and_receive(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    group: GroupEntry,
    pairs: Pairs,
    infos: list[OperandInfo],
    operand: torch.Tensor | None,
) -> torch.Tensor | None:
    assert group.handles is not None
    on_device = _on_device(group, pairs, infos)
    if on_device:
        pg, device = group.handles.data, ctx.device
    elif _on_accelerator(group):
        pg, device = group.handles.control, _CPU
    else:
        pg, device = group.handles.data, _CPU
    tag = desc.op_id & 0x7FFFFFFF
    src = next((s for s, d in pairs if d == ctx.rank), None)
    result: torch.Tensor | None = None
    if src is not None:  # allocated before anything is issued
        info = infos[src]
        assert info.dtype is not None
        result = ctx.replaced.empty(info.shape, info.dtype, device)
    issues: list[Callable[[], Any]] = []
    if operand is not None and operand.numel():
        wire = operand.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        for s, d in pairs:
            if s == ctx.rank:
                peer = group.index(d)
                issues.append(lambda peer=peer: pg.send([wire], peer, tag))
    if src is not None and result is not None and result.numel():
        into, peer = result.reshape(-1).view(torch.uint8), group.index(src)
        issues.append(lambda: pg.recv([into], peer, tag))
    if on_device and issues:
        for work in _coalesced(pg, device, issues):
            work.wait()
    else:
        for work in [issue() for issue in issues]:
            work.wait()
    if result is not None and result.device != ctx.device:
        result = result.to(ctx.device)
    return result


def _coalesced(pg: Any, device: torch.device, issues: list[Callable[[], Any]]) -> list[Any]:
    """``issues`` launched as one NCCL group call; the group's one work."""
    pg._start_coalescing(device)
    try:
        for issue in issues:
            issue()  # in a group call, the launch's work is the one that completes
    finally:
        work = pg._end_coalescing(device)
    return [work]
