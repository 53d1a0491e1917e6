"""The anchor of the uneven all_to_all row: ``torch.distributed.all_to_all_single``
with explicit split sizes over gloo, directly, in fresh processes.

``run_direct_uneven(world, nbytes, repeats)`` spawns ``world`` processes of::

    python -m bench.direct_uneven --rank R --world W --port P --bytes N --repeats K

each of which joins a default gloo group built like the workers' (a PrefixStore
over a TCPStore, rank 0 its master; see ``bench.direct_gloo``), puts ``N`` bytes
of float32 rows in its operand, runs ``all_to_all_single`` with the splits of
:func:`split_matrix` (the service row uses the same ones) a few times as warmup,
then times ``K`` ops one by one. Rank 0 prints ``{"seconds": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

from bench.direct_gloo import spawn_ranks

__all__ = ["ROW_ELEMENTS", "split_matrix", "run_direct_uneven"]

ROW_ELEMENTS = 1024  # float32: rows of 4 KiB
_TIMEOUT_S = 120.0


def split_matrix(world: int, rows: int) -> list[list[int]]:
    """Rows member i sends member j: each row sums to ``rows`` (every operand the same
    size), the columns differ (members receive different amounts), and from 3
    members on, member 0 sends nothing to the last member (a zero-row chunk)."""
    matrix = []
    for i in range(world):
        weights = [1 + (2 * i + j) % (world + 1) for j in range(world)]
        if i == 0 and world > 2:
            weights[-1] = 0
        row = [rows * w // sum(weights) for w in weights]
        row[weights.index(max(weights))] += rows - sum(row)
        matrix.append(row)
    return matrix


def run_direct_uneven(world: int, nbytes: int, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds per ``all_to_all_single`` of ``nbytes`` per rank, one figure per op."""
    args = ["--bytes", str(nbytes), "--repeats", str(repeats), "--warmup", str(warmup)]
    return spawn_ranks("bench.direct_uneven", world, args)["seconds"]


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    a = parser.parse_args()

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=_TIMEOUT_S)
    store = dist.TCPStore(
        "127.0.0.1", a.port, is_master=a.rank == 0, wait_for_workers=False, timeout=timeout
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("g", store), rank=a.rank, world_size=a.world, timeout=timeout
    )
    matrix = split_matrix(a.world, max(1, a.bytes // (4 * ROW_ELEMENTS)))
    send = matrix[a.rank]
    recv = [row[a.rank] for row in matrix]
    x = torch.full((sum(send), ROW_ELEMENTS), float(a.rank + 1))
    out = torch.empty((sum(recv), ROW_ELEMENTS))

    def once() -> None:
        dist.all_to_all_single(out, x, recv, send)

    for _ in range(a.warmup):
        once()
    seconds = []
    for _ in range(a.repeats):
        dist.barrier()  # every rank starts together, as in the service's pipeline
        started = time.perf_counter()
        once()
        seconds.append(time.perf_counter() - started)
    dist.barrier()
    if a.rank == 0:
        print(json.dumps({"seconds": seconds}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown around gloo threads


if __name__ == "__main__":
    _main()
