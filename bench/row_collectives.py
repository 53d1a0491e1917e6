"""Row 3: remote all_reduce / broadcast / all_gather against direct gloo.

The service side runs on a ``shared_cluster(world)``: the operand is put on every
rank first (a different value per rank), then only the collective call is
timed, as the SDK client sees it (descriptor broadcast, operand checks, the
data collective, outcome all-gather, commit, barrier, the leader's answer).
``all_gather`` returns the gathered parts, so its call also downloads
``world x size`` bytes from one worker. The anchor is torch.distributed gloo
directly in ``world`` fresh processes built like the workers' groups
(bench/direct_gloo.py), measured in the same run.

The largest all_reduce has a second row, against direct gloo that first copies
the operand (``all_reduce_copy``): the service leaves the input tensor as it
was and writes the result under another name (and an op that fails leaves every
value as it was), and gloo only reduces in place, so every rank used to copy its operand before the
collective. A sum of 1 MiB or more now runs a ring of gloo sends that reads
the operand where it is (``worker/ring_reductions.py``); the row shows
the copy it saves (min, max and other dtypes still copy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import collectives
from bench.core import BenchContext, MiB, Row, measure, shared_cluster, stat_of
from bench.direct_gloo import OPS, run_direct

__all__ = ["run"]

# The "remote all_reduce 64 MiB >= 0.9x direct gloo" throughput target,
# written as a time ratio (service/anchor): 1 / 0.9 = 1.11.
ALL_REDUCE_TARGET = "<= 1.11"


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes} B"


def _service(
    world: int, sizes: list[int], repeats: Callable[[int], int]
) -> dict[tuple[str, int], object]:
    results = {}
    with collectives.connect(shared_cluster(world), timeout=60.0) as cluster:
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            for rank in range(world):
                cluster.put("bench/x", torch.full((numel,), float(rank + 1)), rank=rank)
            calls = {
                "all_reduce": lambda: cluster.all_reduce("bench/x", op="sum", out="bench/y"),
                "broadcast": lambda: cluster.broadcast("bench/x", src=0),
                "all_gather": lambda: cluster.all_gather("bench/x", out="bench/g"),
            }
            try:
                for op in OPS:
                    results[(op, nbytes)] = measure(calls[op], repeats(nbytes), warmup=2)
            finally:  # the cluster is shared with other rows
                for name in ("bench/x", "bench/y", "bench/g"):
                    cluster.delete(name, missing_ok=True)
    return results


def run(ctx: BenchContext) -> list[Row]:
    sizes = ctx.sizes([4, 64 * MiB], [4, 16 * MiB])
    worlds = [2] if ctx.quick else [2, 3]

    def repeats(nbytes: int) -> int:
        """Enough samples for a p99 to mean something: the tails are a target too. With
        40, the p99 of a 4 B op was its worst sample but one; 200 take ~1 s per row."""
        if ctx.quick:
            return ctx.repeats
        return 200 if nbytes < MiB else 12

    rows = []
    for world in worlds:
        anchor = {}
        for nbytes in sizes:  # the same number of samples as the service's
            ops = [*OPS, "all_reduce_copy"] if nbytes == max(sizes) else list(OPS)
            anchor.update(run_direct(ops, world, [nbytes], repeats(nbytes)))
        service = _service(world, sizes, repeats)
        for op in OPS:
            for nbytes in sizes:
                big = nbytes == max(sizes) and op in ("all_reduce", "broadcast")
                stat = service[(op, nbytes)]
                tail = stat.p99 / stat.median if stat.p99 and stat.median else float("nan")
                notes = [f"p99/p50 {tail:.2f} (target <= 2)"]
                if big:
                    notes.append(
                        f"target: 64 MiB {op} >= 0.9x direct gloo in throughput, i.e. "
                        "time ratio <= 1.11"
                        + (" (quick mode measures 16 MiB)" if nbytes != 64 * MiB else "")
                    )
                elif op == "all_gather":
                    notes.append("service call includes downloading the world x size result")
                rows.append(
                    Row(
                        group="3 collectives",
                        what=f"{op} {_label(nbytes)} world {world}",
                        service=stat,
                        anchor_name=f"direct gloo {op}, {world} processes",
                        anchor=stat_of(anchor[(op, nbytes)], "s"),
                        target=ALL_REDUCE_TARGET if big else "",
                        note="; ".join(notes),
                        extra={"world": world, "bytes": nbytes, "op": op, "p99_over_p50": tail},
                    )
                )
        rows.append(_copy_row(world, max(sizes), service, anchor))
    return rows


def _copy_row(world: int, nbytes: int, service: dict, anchor: dict) -> Row:
    return Row(
        group="3 collectives",
        what=f"all_reduce {_label(nbytes)} world {world}, against copy + all_reduce",
        service=service[("all_reduce", nbytes)],
        anchor_name=f"direct gloo: memmove the operand, all_reduce the copy, {world} processes",
        anchor=stat_of(anchor[("all_reduce_copy", nbytes)], "s"),
        note=(
            "no target. The service keeps the operand as it was (out= name; a failed op "
            "changes nothing) and gloo reduces only in place, so it used to copy the operand "
            "first, as this anchor does; a sum this large now runs a ring of gloo sends that "
            "reads the operand in place (min, max and other dtypes still copy)"
        ),
        extra={"world": world, "bytes": nbytes},
    )
