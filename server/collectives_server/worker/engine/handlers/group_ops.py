"""The handlers of ``new_group`` and ``destroy_group``: every rank takes part.

Like ``dist.new_group``, creating a group is collective over the whole world:
members build their gloo (and NCCL) groups under a store prefix of this
generation's, non-members record the membership (and, on accelerator workers,
take part in the split of the world's NCCL communicator), and every rank agrees
on the outcome before the group becomes usable. Groups live as long as the
generation they were made in (a group rebuilt in a new epoch keeps them:
``carried_groups``), or until ``destroy_group``; at most ``ctx.max_groups``.

``destroy_group`` is sequenced like any op, so every rank drops the group at the
same point of the op order; the verdict (group 0, an unknown or already destroyed
group) is the same on every rank because every rank holds the same groups there,
so it needs no agreement. An op admitted for a group that a ``destroy_group``
ahead of it in the queue removed fails NOT_FOUND on every rank
(:func:`missing_group`, checked by the generation loop before dispatching).
"""

from __future__ import annotations

from typing import Any

import grpc

from collectives.errors import CollectiveError, InvalidArgument, NotFound, ResourceExhausted
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine import agreement
from collectives_server.worker.engine.op_context import (
    Announcement,
    GroupEntry,
    OpContext,
    OpResult,
)
from collectives_server.worker.engine.process_groups import (
    build_groups,
    check_group_cap,
    nccl_group,
    sit_out_split,
    split_of,
    subgroup_count,
)
from collectives_server.worker.kernels import op_failures

__all__ = ["build_group", "run_new_group", "run_destroy_group", "group_not_found", "missing_group"]


def run_new_group(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> OpResult | CollectiveError:
    ann.wait(ctx)
    ranks = sorted(desc.new_group.ranks)
    handles = None
    code, message = grpc.StatusCode.OK, ""
    try:
        check_group_cap(subgroup_count(ctx.groups), ctx.max_groups, ctx.generation)
    except ResourceExhausted as exc:
        code, message = exc.code, exc.message
    if code == grpc.StatusCode.OK:
        try:
            handles = build_group(ctx, desc.group_id, ranks)
        except Exception as exc:
            code = grpc.StatusCode.UNAVAILABLE
            message = f"could not build group: {op_failures.backend_message(exc)}"
    failures = ctx.call(agreement.agree, ctx.control, ctx.world_size, code, message)
    if failures:
        return ctx.fail_all(failures)
    ctx.groups[desc.group_id] = GroupEntry(desc.group_id, ranks, handles)
    return OpResult(desc.op_id, ctx.generation, "", ranks, None, (), 0.0)


def build_group(ctx: OpContext, group_id: int, ranks: list[int]) -> Any:
    """Sub-group ``group_id`` of ``ranks`` (global, ascending): its handles on a member,
    None on a rank outside it (which still takes part in an NCCL split). Every rank
    of the generation calls it, in the same order. Raises what the backend raises."""
    world = ctx.groups[0].handles
    assert world is not None
    if ctx.rank not in ranks:
        sit_out_split(world, ctx.device)
        return None
    return build_groups(
        ctx.tcp_store,
        f"{ctx.prefix}/grp{group_id}",
        ranks.index(ctx.rank),
        len(ranks),
        ctx.timeout_s,
        ctx.device,
        ctx.host,
        nccl=world.nccl or nccl_group,
        split=split_of(world, group_id, ranks),
    )


def group_not_found(group_id: int, generation: int) -> NotFound:
    """The NOT_FOUND of a group id that this generation does not hold (one wording)."""
    return NotFound(
        f"group {group_id} does not exist in generation {generation}; it was destroyed, or "
        "made in another generation (groups last as long as the generation they were made "
        "in, or until destroy_group): create it again"
    )


def run_destroy_group(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> OpResult | CollectiveError:
    ann.wait(ctx)
    group_id = desc.destroy_group.group_id
    if group_id == 0:
        return InvalidArgument("group 0 is every rank of the generation; it cannot be destroyed")
    entry = ctx.groups.pop(group_id, None)
    if entry is None:
        return group_not_found(group_id, ctx.generation)
    # NCCL groups are aborted; dropping the last reference frees the gloo groups'
    # sockets and threads (process_groups).
    if entry.handles is not None:
        entry.handles.release()
    entry.handles = None
    return OpResult(desc.op_id, ctx.generation, "", entry.ranks, None, (), 0.0)


def missing_group(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> CollectiveError | None:
    """NOT_FOUND for an op on a group this rank no longer holds (a ``destroy_group``
    sequenced before it), identical on every rank; None when the group exists."""
    if desc.kind in (OpKind.NEW_GROUP, OpKind.DESTROY_GROUP) or desc.group_id in ctx.groups:
        return None
    ann.wait(ctx)
    return group_not_found(desc.group_id, ctx.generation)
