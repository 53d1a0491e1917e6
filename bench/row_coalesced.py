"""Row 3b: a coalesced all_reduce of 200 x 4 KiB, against direct gloo and against
the same 200 tensors as 200 separate service calls.

On a ``shared_cluster(world)``, 200 float32 tensors of 4 KiB are put on every
rank (a different value per rank); then only the calls are timed, as the SDK
client sees them: ``cluster.all_reduce(names)`` (one op: one operand exchange,
one data collective for the one dtype, one agreement) and, for the second row,
``cluster.all_reduce(name)`` for each of the 200 names in turn (200 ops). The
anchors are gloo's own ``allreduce_coalesced`` in ``world`` fresh processes
(bench/direct_coalesced.py), measured in the same run, and those 200 calls.
"""

from __future__ import annotations

import torch

import collectives
from bench.core import BenchContext, Row, Stat, measure, shared_cluster, stat_of
from bench.direct_coalesced import run_direct_coalesced

__all__ = ["run"]

COUNT = 200
BYTES_EACH = 4096
# The ">= 5x faster than separate calls", as a time ratio (coalesced/separate).
SPEEDUP_TARGET = "<= 0.2"


def _service(world: int, repeats: int) -> tuple[Stat, Stat]:
    """(one coalesced call, 200 separate calls), each the time of the whole batch."""
    names = [f"bench/coalesced/{i}" for i in range(COUNT)]
    with collectives.connect(shared_cluster(world), timeout=60.0) as cluster:
        try:
            for rank in range(world):
                value = torch.full((BYTES_EACH // 4,), float(rank + 1))
                for name in names:
                    cluster.put(name, value, rank=rank)
            coalesced = measure(lambda: cluster.all_reduce(names, op="sum"), repeats, warmup=1)

            def separate() -> None:
                for name in names:
                    cluster.all_reduce(name, op="sum")

            one_by_one = measure(separate, max(3, repeats // 2), warmup=1)
        finally:  # the cluster is shared with other rows
            for name in names:
                cluster.delete(name, missing_ok=True)
    return coalesced, one_by_one


def run(ctx: BenchContext) -> list[Row]:
    worlds = [2] if ctx.quick else [2, 3]
    repeats = ctx.repeats if ctx.quick else 2 * ctx.repeats
    label = f"{COUNT} x {BYTES_EACH // 1024} KiB"
    rows = []
    for world in worlds:
        anchor = run_direct_coalesced(world, COUNT, BYTES_EACH, repeats)
        coalesced, one_by_one = _service(world, repeats)
        speedup = one_by_one.median / coalesced.median if coalesced.median else float("nan")
        extra = {"world": world, "count": COUNT, "bytes_each": BYTES_EACH}
        rows.append(
            Row(
                group="3 collectives",
                what=f"coalesced all_reduce {label} world {world}",
                service=coalesced,
                anchor_name=f"direct gloo allreduce_coalesced, {world} processes",
                anchor=stat_of(anchor, "s"),
                note="one service op: operand exchange of 200 infos, 1 data collective, agreement",
                extra=extra,
            )
        )
        rows.append(
            Row(
                group="3 collectives",
                what=f"coalesced vs {COUNT} separate all_reduce, {label} world {world}",
                service=coalesced,
                anchor_name=f"the same {COUNT} tensors as {COUNT} service all_reduce calls",
                anchor=one_by_one,
                target=SPEEDUP_TARGET,
                note=f"speed-up {speedup:.1f}x (target >= 5x, i.e. time ratio <= 0.2)",
                extra={**extra, "speedup": speedup},
            )
        )
    return rows
