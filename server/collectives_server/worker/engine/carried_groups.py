"""A generation a drain carried over keeps the groups of the one before.

A drain hands a rank to its successor with everything the rank held, so the
next generation is the same membership rank for rank (``carried_over``), and a
group made with ``new_group`` means the same ranks in it. As a generation's
first step (after its models), when it is carried over, every rank sends the
groups it held in the generation before (id -> global ranks; the successor held
none) and every rank builds each group the others name, under the same id, in
id order, as ``new_group`` builds one. A group a client made before the drain
works after it; the next new group gets an id above them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from collectives_server.worker.engine import agreement
from collectives_server.worker.engine.handlers.group_ops import build_group
from collectives_server.worker.engine.op_context import GroupBroken, GroupEntry, OpContext
from collectives_server.worker.kernels import op_failures

__all__ = ["rebuild_groups"]

log = logging.getLogger(__name__)


def rebuild_groups(ctx: OpContext, held: Mapping[int, Sequence[int]]) -> int:
    """Builds the groups any rank held before (``held``: this rank's) into ``ctx.groups``;
    returns the id the next new group may take."""
    tables = agreement.all_gather_json(
        ctx.call, ctx.control, ctx.world_size, {str(k): list(v) for k, v in held.items()}
    )
    # Ranks that held groups held the same ones (they ran the same ops); the successor
    # holds none. The lowest rank that names any is taken.
    named = next((t for t in tables if t), {})
    groups = sorted((int(k), sorted(v)) for k, v in named.items())
    for group_id, ranks in groups:
        if any(not 0 <= r < ctx.world_size for r in ranks):
            log.error("not carrying group %d over: ranks %s outside the world", group_id, ranks)
            continue
        try:
            handles = build_group(ctx, group_id, ranks)
        except Exception as exc:
            raise GroupBroken(
                f"could not carry group {group_id} over: {op_failures.backend_message(exc)}"
            ) from exc
        ctx.groups[group_id] = GroupEntry(group_id, ranks, handles)
    if groups:
        log.info("carried %d groups over into generation %d", len(groups), ctx.generation)
    return max((group_id for group_id, _ in groups), default=0) + 1
