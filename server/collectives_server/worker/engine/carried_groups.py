"""A generation a drain carried over keeps the groups of the one before.

A drain hands a rank to its successor with everything the rank held, so the
next generation is the same membership rank for rank (``carried_over``), and a
group made with ``new_group`` means the same ranks in it. As a generation's
first step (after its models), when it is carried over, every rank sends the
groups it held in the generation before (id -> global ranks; the successor held
none) and every rank builds each group the others name, under the same id, in
id order, as ``new_group`` builds one. A group a client made before the drain
works after it; the next new group gets an id above them.

A generation whose group broke and is rebuilt in a new epoch (the same members)
keeps its groups the same way, but only those every rank held alike: a
``new_group`` or ``destroy_group`` the break cut short may have been done on some
ranks and not on others, and its client was told it failed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from collectives_server.worker.engine import agreement
from collectives_server.worker.engine.handlers.group_ops import build_group
from collectives_server.worker.engine.op_context import GroupBroken, GroupEntry, OpContext
from collectives_server.worker.kernels import op_failures

__all__ = ["carried", "rebuild_groups"]

log = logging.getLogger(__name__)


def rebuild_groups(
    ctx: OpContext, held: Mapping[int, Sequence[int]], *, held_by_all: bool = False
) -> int:
    """Builds the groups any rank held before (``held``: this rank's) into ``ctx.groups``
    (with ``held_by_all``: those every rank held alike); returns the id the next new
    group may take."""
    tables = agreement.all_gather_json(
        ctx.call, ctx.control, ctx.world_size, {str(k): list(v) for k, v in held.items()}
    )
    groups = carried(tables, held_by_all)
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
    return max((int(k) for t in tables for k in t), default=0) + 1


def carried(tables: list[dict[str, list[int]]], held_by_all: bool) -> list[tuple[int, list[int]]]:
    """The groups to build again, by id, from every rank's table (id -> global ranks):
    with ``held_by_all`` those every rank holds alike, else those of the lowest rank
    that holds any (a drain's successor holds none; the others hold the same ones,
    having run the same ops)."""
    if held_by_all:
        named = {k: v for k, v in tables[0].items() if all(t.get(k) == v for t in tables)}
    else:
        named = next((t for t in tables if t), {})
    return sorted((int(k), sorted(v)) for k, v in named.items())
