"""The handler of ``replicate``: ``put(name, t)`` on every rank, each byte sent once.

The client put the tensor once, on the leader, under an upload name
(``__publish/<id>/<key>``, ``args.name``); ``args.out`` is the name every rank
stores it under and ``args.root`` the leader's rank. On every rank, after the
announcement:

  1. one all-gather of operand infos: the root describes its upload (absent if
     it expired or was deleted), every rank its store's quota state for the
     target; the root's counts the upload out (it keeps that very tensor);
  2. the verdict, identical everywhere (``validation.decide`` with the
     replicate spec: the root's operand, stored by every member): the upload
     gone (NOT_FOUND) or the tensor over some rank's quota (RESOURCE_EXHAUSTED)
     fails every rank before any data moves;
  3. one gloo broadcast of the upload's bytes from the root into a private
     buffer on every other rank (``collective_ops.broadcast``, on memory the
     rank's last replaced result left, ``ctx.replaced``). One broadcast for the
     whole tensor: broadcasting it in 25 MiB buckets, serially or with two or
     all of them in flight, is no faster (gloo
     sends the whole buffer down its tree either way; the root's egress is the
     same), so the simpler form stays;
  4. an agreement on every rank's outcome, then every rank commits: followers
     their buffer (``store.replace``), the root the upload itself
     (``store.adopt``: no copy, and the upload name is gone in the same step).

A follower fences the target before the agreement (its last exchange) and lifts
the fence once committed, as the tensor ops do, so a client reading any rank
right after the put returned sees the new value. The root removes the upload
whatever happens: a failed op leaves every rank's old value in place.
"""

from __future__ import annotations

import grpc
import torch

from collectives.errors import CollectiveError, Reason, error_for_code
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind, spec
from collectives_server.worker.data.store import Fence, upload_prefix
from collectives_server.worker.engine import agreement, validation
from collectives_server.worker.engine.op_context import (
    Announcement,
    GroupBroken,
    OpContext,
    OpResult,
)
from collectives_server.worker.kernels import collective_ops, op_failures

__all__ = ["run_replicate", "decide_replicate"]

_SPEC = spec(OpKind.REPLICATE)


def decide_replicate(
    upload: str,
    target: str,
    members: list[int],
    infos: list[validation.OperandInfo],
    root: int,
) -> validation.Plan | validation.OpError:
    """The verdict every rank reaches from the exchanged infos (indexed by global rank)."""
    if infos[root].state != validation.PRESENT:
        return validation.OpError(
            grpc.StatusCode.NOT_FOUND,
            f"the upload of {target!r} ({upload!r}) is gone from the leader (rank {root}): "
            "expired or deleted before the op ran; put again",
            reason=Reason.OPERAND_MISSING,
            ranks=(root,),
        )
    return validation.decide(_SPEC, upload, members, infos, root, target=target)


def run_replicate(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> OpResult | CollectiveError:
    args = desc.replicate
    root = args.root
    try:
        return _replicate(ctx, desc, ann)
    finally:
        if ctx.rank == root:
            ctx.store.delete_prefix(upload_prefix(args.name))


def _replicate(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> OpResult | CollectiveError:
    args = desc.replicate
    root, target = args.root, args.out
    upload = ctx.operand(args.name) if ctx.rank == root else None
    held, limit = ctx.store.quota_state(target)
    if upload is not None:
        held -= upload.numel() * upload.element_size()  # adopted, not copied
    values = validation.info_values(upload, True, (max(held, 0), limit))
    exchanged = ctx.call(
        agreement.exchange, ctx.control, ctx.world_size, values, None, 0, ann.pending
    )
    ann.pending = None
    members = list(range(ctx.world_size))
    plan = decide_replicate(args.name, target, members, exchanged.infos, root)
    if isinstance(plan, validation.OpError):
        return error_for_code(plan.code, plan.message, reason=plan.reason, ranks=plan.ranks)
    fence: Fence | None = None
    if ctx.rank != root:
        fence = ctx.store.fence(target, 2 * ctx.timeout_s)  # the agreement is the last exchange
    try:
        received, code, message = _receive(ctx, plan, upload, root)
        # A follower commits its received buffer; the root keeps the upload itself,
        # adopted below once every rank agreed (its replaced value is offered too:
        # the root's next upload of this size, a put, lands in it).
        error = ctx.agree_and_commit(code, message, {} if ctx.rank == root else {target: received})
        if error is not None:
            return error
        if ctx.rank == root:
            assert upload is not None
            old = ctx.store.adopt(target, upload, args.name)
            if old is not None:
                ctx.replaced.offer(old)
            del old
    finally:
        if fence is not None:
            fence.release()
    return OpResult(
        desc.op_id,
        ctx.generation,
        target,
        members,
        plan.dtype,
        plan.shape,
        0.0,
    )


def _receive(
    ctx: OpContext,
    plan: validation.Plan,
    upload: torch.Tensor | None,
    root: int,
) -> tuple[torch.Tensor | None, grpc.StatusCode, str]:
    """The broadcast: (this follower's private copy or None on the root, outcome)."""
    world = ctx.groups[0]
    assert world.handles is not None and plan.dtype is not None
    if upload is not None and upload.device != ctx.device:
        upload = upload.to(ctx.device)
    try:
        got = collective_ops.broadcast(
            world.handles.data,
            upload,
            root,
            ctx.rank,
            plan.dtype,
            plan.shape,
            ctx.device,
            ctx.replaced.empty,
        )
    except Exception as exc:
        if op_failures.is_transport_failure(exc):
            raise GroupBroken(op_failures.backend_message(exc)) from exc
        code, message = op_failures.local_failure(exc, _SPEC.name, plan.dtype)
        return None, code, message
    ctx.count_data_collectives(1)
    return got, grpc.StatusCode.OK, ""
