"""The handler of ``new_group``: every rank takes part, members build the group.

Like ``dist.new_group``, creating a group is collective over the whole world:
members build their gloo (and NCCL) groups under a store prefix of this
generation's, non-members only record the membership, and every rank agrees on
the outcome before the group becomes usable. Groups live as long as the
generation (and its epoch) they were made in; at most ``ctx.max_groups``.
"""

from __future__ import annotations

import grpc

from collectives.errors import CollectiveError, ResourceExhausted
from collectives.v1 import worker_pb2
from collectives_server.worker import agreement, op_failures
from collectives_server.worker.group_cap import check_group_cap, subgroup_count
from collectives_server.worker.op_context import Announcement, GroupEntry, OpContext, OpResult
from collectives_server.worker.process_groups import build_groups

__all__ = ["run_new_group"]


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
    if ctx.rank in ranks and code == grpc.StatusCode.OK:
        try:
            handles = build_groups(
                ctx.tcp_store,
                f"{ctx.prefix}/grp{desc.group_id}",
                ranks.index(ctx.rank),
                len(ranks),
                ctx.timeout_s,
                ctx.device,
                ctx.host,
            )
        except Exception as exc:
            code = grpc.StatusCode.UNAVAILABLE
            message = f"could not build group: {op_failures.backend_message(exc)}"
    failures = ctx.call(agreement.agree, ctx.control, ctx.world_size, code, message)
    if failures:
        return ctx.fail_all(failures)
    ctx.groups[desc.group_id] = GroupEntry(desc.group_id, ranks, handles)
    return OpResult(desc.op_id, ctx.generation, "", ranks, None, (), 0.0)
