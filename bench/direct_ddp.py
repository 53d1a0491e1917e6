"""The anchor of row 6: a torch DDP training step in ``world`` fresh processes.

``run_ddp(world, widths, batch, repeats)`` spawns ``world`` processes of
``python -m bench.direct_ddp ...``; each initialises the default process group
with ``dist.init_process_group("gloo", store=TCPStore(...))``, wraps the
benchmark MLP (``mlp(widths)``, seeded, so every replica starts equal) in
``DistributedDataParallel`` and times ``repeats`` steps (zero_grad, forward on
its shard of the global batch, MSE loss, backward with DDP's bucketed
all-reduce, SGD step) after a warmup, each rank on ``cores // world`` intra-op
threads (see ``ddp_threads``). With ``--flat-bytes N`` the same processes then
time a flat all-reduce of N bytes on a gloo group built like the workers'
(``bench.direct_gloo.gloo_group``): the anchor of ``all_reduce_gradients``.
Rank 0 prints ``{"ddp": [...], "flat": [...]}`` (seconds, one figure per op).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn

from bench.direct_gloo import gloo_group, spawn_ranks, time_op

__all__ = ["mlp", "param_count", "batch_of", "ddp_threads", "run_ddp"]

LR = 0.01


def mlp(widths: tuple[int, ...], seed: int = 0) -> nn.Module:
    """Linear layers of ``widths`` with ReLU between them, seeded."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def param_count(widths: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(widths))


def batch_of(
    widths: tuple[int, ...], batch: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, targets), identical wherever it is made."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, widths[0], generator=gen)
    y = torch.randn(batch, widths[-1], generator=gen)
    return x, y


def ddp_threads(world: int) -> int:
    """Intra-op threads per DDP rank: an equal share of the cores. torchrun's
    default is 1 when it starts several ranks per node; with the default (every
    core per rank) DDP's gloo thread, overlapping backward, fights the OpenMP
    threads and a step is several times slower (docs/perf-log.md, "DDP anchor threads")."""
    return max(1, (os.cpu_count() or 1) // world)


def run_ddp(
    world: int,
    widths: tuple[int, ...],
    batch: int,
    repeats: int,
    warmup: int = 2,
    flat_bytes: int = 0,
) -> dict[str, list[float]]:
    """Seconds per DDP step (``"ddp"``, one figure per step) and, with ``flat_bytes``,
    per flat all-reduce of that many bytes (``"flat"``) on a gloo group built like the
    workers' (bench/direct_gloo.py), in the same processes after the steps."""
    args = ["--widths", ",".join(map(str, widths)), "--batch", str(batch)]
    args += ["--repeats", str(repeats), "--warmup", str(warmup), "--flat-bytes", str(flat_bytes)]
    args += ["--threads", str(ddp_threads(world))]
    return spawn_ranks("bench.direct_ddp", world, args)


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--widths", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--flat-bytes", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812 - the conventional name
    from torch.nn.parallel import DistributedDataParallel

    widths = tuple(int(w) for w in a.widths.split(","))
    store = dist.TCPStore(
        "127.0.0.1",
        a.port,
        is_master=a.rank == 0,
        wait_for_workers=False,
        timeout=timedelta(seconds=120),
    )
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world)
    model = DistributedDataParallel(mlp(widths))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = batch_of(widths, a.batch)
    x, y = x.chunk(a.world)[a.rank], y.chunk(a.world)[a.rank]

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    seconds = []
    for _ in range(a.repeats):
        dist.barrier()
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    dist.barrier()
    result = {"ddp": seconds}
    if a.flat_bytes:
        _, pg = gloo_group(a.rank, a.world, store=store)
        flat = torch.ones(max(1, a.flat_bytes // 4))
        result["flat"] = time_op(pg, "all_reduce", flat, [], a.warmup, a.repeats)
        pg.barrier().wait()
    if a.rank == 0:
        print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown around gloo threads


if __name__ == "__main__":
    _main()
