"""The anchor of the coalesced row: gloo's own ``allreduce_coalesced`` of many small
tensors, in fresh processes built like the workers' groups (``direct_gloo.gloo_group``).

``python -m bench.direct_coalesced --rank R --world W --port P --count N --bytes-each B``
times ``K`` coalesced all-reduces of ``N`` float32 tensors of ``B`` bytes each, one by
one (every rank starting together after a barrier); rank 0 prints
``{"seconds": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.direct_gloo import gloo_group, spawn_ranks

__all__ = ["run_direct_coalesced"]


def run_direct_coalesced(
    world: int, count: int, bytes_each: int, repeats: int, warmup: int = 2
) -> list[float]:
    """Seconds per ``allreduce_coalesced`` of ``count`` tensors of ``bytes_each`` bytes."""
    args = ["--count", str(count), "--bytes-each", str(bytes_each)]
    args += ["--repeats", str(repeats), "--warmup", str(warmup)]
    return spawn_ranks("bench.direct_coalesced", world, args)["seconds"]


def _main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--rank", "--world", "--port", "--count", "--bytes-each"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    a = parser.parse_args()

    import torch
    import torch.distributed as dist

    store, pg = gloo_group(a.rank, a.world, a.port)
    numel = max(1, a.bytes_each // 4)
    tensors = [torch.full((numel,), float(a.rank + 1)) for _ in range(a.count)]
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    for _ in range(a.warmup):
        pg.allreduce_coalesced(tensors, opts).wait()
    seconds = []
    for _ in range(a.repeats):
        pg.barrier().wait()
        started = time.perf_counter()
        pg.allreduce_coalesced(tensors, opts).wait()
        seconds.append(time.perf_counter() - started)
    pg.barrier().wait()
    if a.rank == 0:
        print(json.dumps({"seconds": seconds}), flush=True)
    del pg, store
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown around gloo threads


if __name__ == "__main__":
    _main()
