"""Row: uneven all_to_all (``all_to_all(split_sizes=...)``) against direct gloo.

The service side runs on a ``shared_cluster(world)``: every rank holds ``nbytes``
of float32 rows (4 KiB each), and only the call is timed, as the SDK client sees
it (descriptor broadcast, operand checks with the row sums, ``alltoall_base``,
outcome all-gather, commit, the leader's answer). The anchor is
``torch.distributed.all_to_all_single`` over gloo in ``world`` fresh processes
with the same split sizes (``bench.direct_uneven.split_matrix``), measured in
the same run.
"""

from __future__ import annotations

import torch

import collectives
from bench.core import BenchContext, MiB, Row, measure, shared_cluster, stat_of
from bench.direct_uneven import ROW_ELEMENTS, run_direct_uneven, split_matrix

__all__ = ["run"]

_NAMES = ("bench/uneven", "bench/uneven_out")


def _service(world: int, matrix: list[list[int]], repeats: int):
    with collectives.connect(shared_cluster(world), timeout=60.0) as cluster:
        try:
            for rank in range(world):
                x = torch.full((sum(matrix[rank]), ROW_ELEMENTS), float(rank + 1))
                cluster.put(_NAMES[0], x, rank=rank)
            return measure(
                lambda: cluster.all_to_all(_NAMES[0], out=_NAMES[1], split_sizes=matrix),
                repeats,
                warmup=1,
            )
        finally:  # the cluster is shared with other rows
            for name in _NAMES:
                cluster.delete(name, missing_ok=True)


def run(ctx: BenchContext) -> list[Row]:
    (nbytes,) = ctx.sizes([64 * MiB], [4 * MiB])
    worlds = [2] if ctx.quick else [2, 3]
    rows = []
    for world in worlds:
        matrix = split_matrix(world, max(1, nbytes // (4 * ROW_ELEMENTS)))
        anchor = run_direct_uneven(world, nbytes, ctx.repeats)
        service = _service(world, matrix, ctx.repeats)
        rows.append(
            Row(
                group="3 collectives",
                what=f"uneven all_to_all {nbytes // MiB} MiB world {world}",
                service=service,
                anchor_name=f"direct gloo all_to_all_single, {world} processes",
                anchor=stat_of(anchor, "s"),
                note="same split sizes on both sides; every rank sends the same bytes, "
                "receives its column's"
                + (" (quick mode measures 4 MiB)" if nbytes != 64 * MiB else ""),
                extra={"world": world, "bytes": nbytes, "split_sizes": matrix},
            )
        )
    return rows
