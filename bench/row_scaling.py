"""Row 11: scaling of ``cluster.all_reduce`` with the world size and the number of clients.

For each world size (full: 2, 3, 4; quick: 2), on ``shared_cluster(world)``:
- one client's per-op time of an in-place ``all_reduce(op="sum")`` of 4 bytes and
  of 64 MiB (quick: 1 MiB), p50/p99 over every op; anchor: direct gloo all_reduce
  of the same size in ``world`` fresh processes (bench/direct_gloo.py), same run;
- 8 and 32 concurrent clients' aggregate ops/s at 4 bytes; anchor: the one
  client's ops/s at that world, same run.

The clients, their bounded loops and the check of every result are those of row
4b (bench/concurrent_clients.py). No targets: the rows show how the figures
move with the world size. World sizes above the machine's cores oversubscribe
it (workers, coordinator and client share the cores; so do the anchor's
processes); the notes say so. The clusters of worlds 3 and 4 are stopped after
their rows (this row runs last).
"""

from __future__ import annotations

import os

from .concurrent_clients import ConcurrentResult, Plan, run_clients
from .core import BenchContext, MiB, Row, close_shared_cluster, shared_cluster, stat_of
from .direct_gloo import run_direct

NAME = "scaling"
GROUP = "11 scaling"
SMALL = 4
CLIENTS = (8, 32)


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes} B"


def _cores(world: int) -> str:
    """The note on the machine: world sizes above its cores oversubscribe it."""
    cores = os.cpu_count() or 0
    if world <= cores:
        return f"os.cpu_count() {cores}: workers, coordinator and clients share the cores"
    return (
        f"OVERSUBSCRIBED: {world} workers on os.cpu_count() {cores} cores (plus the "
        "coordinator and clients; the anchor's processes likewise)"
    )


def _anchors(world: int, big: int, quick: bool) -> dict[int, list[float]]:
    """Direct gloo seconds per all_reduce at ``SMALL`` and ``big`` bytes (one set of
    processes measures both)."""
    repeats = [50, 5] if quick else [100, 5]
    got = run_direct(["all_reduce"], world, [SMALL, big], repeats)
    return {n: got[("all_reduce", n)] for n in (SMALL, big)}


def _time_row(
    world: int, nbytes: int, run: ConcurrentResult, anchor: list[float], where: str
) -> Row:
    return Row(
        group=GROUP,
        what=f"all_reduce {_label(nbytes)} world {world}: 1 client",
        service=run.latency(),
        anchor_name=f"direct gloo all_reduce, {world} processes",
        anchor=stat_of(anchor, "s"),
        note=f"{run.summary()}; {where}",
        extra={"service": run.as_extra(), "anchor_samples": len(anchor)},
    )


def _rate_row(world: int, run: ConcurrentResult, single: ConcurrentResult, where: str) -> Row:
    return Row(
        group=GROUP,
        what=f"all_reduce 4 B world {world}: {run.clients} clients aggregate ops/s",
        service=run.ops_per_s(),
        anchor_name=f"1 client ops/s at world {world}",
        anchor=single.ops_per_s(),
        note=f"{run.summary()}; anchor {single.summary()}; {where}",
        extra={"service": run.as_extra(), "anchor": single.as_extra()},
    )


def _world_rows(ctx: BenchContext, world: int) -> list[Row]:
    big = MiB if ctx.quick else 64 * MiB
    small_plan = (
        Plan(rounds=1, duration_s=0.75, max_ops=2_000)
        if ctx.quick
        else Plan(rounds=2, duration_s=1.0, max_ops=10_000)
    )
    big_plan = Plan(rounds=1, duration_s=60.0, max_ops=ctx.repeats, warmup=1)
    where = _cores(world)
    anchors = _anchors(world, big, ctx.quick)
    address = shared_cluster(world)
    prefix = f"bench/scaling/{world}"
    single = run_clients(address, world, 1, small_plan, prefix=f"{prefix}/1")
    large = run_clients(address, world, 1, big_plan, nbytes=big, prefix=f"{prefix}/big")
    rows = [
        _time_row(world, SMALL, single, anchors[SMALL], where),
        _time_row(world, big, large, anchors[big], where),
    ]
    for clients in CLIENTS:
        many = run_clients(address, world, clients, small_plan, prefix=f"{prefix}/{clients}")
        rows.append(_rate_row(world, many, single, where))
    return rows


def run(ctx: BenchContext) -> list[Row]:
    worlds = [2] if ctx.quick else [2, 3, 4]
    rows: list[Row] = []
    for world in worlds:
        try:
            rows.extend(_world_rows(ctx, world))
        finally:
            if world != 2:  # world 2 is every row's cluster; no row after this one uses 3 or 4
                close_shared_cluster(world)
    return rows
