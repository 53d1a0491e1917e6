"""A/B probe: a 4 B gloo all_reduce right after an 8 MiB CPU copy, by copy and by
OpenMP wait policy (docs/perf-log.md, "OpenMP's wait policy against the worker's
plain copies"). Two ranks on loopback; prints the copy's p50 and the all_reduce's
p50 and p99.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.omp_wait_probe copy

MODE: ``copy`` (``Tensor.copy_``), ``memmove`` (one ``ctypes.memmove``) or ``none``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COPY_BYTES = 8 << 20
ROUNDS = 400
WARM_UP = 20


def _rank(rank: int, port: int, mode: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    src = torch.randn(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    x = torch.randn(1)
    reduce_s: list[float] = []
    copy_s: list[float] = []
    for i in range(WARM_UP + ROUNDS):
        dist.barrier()
        copied = time.perf_counter()
        if mode == "copy":
            dst.copy_(src)
        elif mode == "memmove":
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), COPY_BYTES)
        started = time.perf_counter()
        dist.all_reduce(x)
        if i >= WARM_UP:
            reduce_s.append(time.perf_counter() - started)
            copy_s.append(started - copied)
    if rank == 0:
        reduce_s.sort()
        p99 = reduce_s[int(0.99 * len(reduce_s))]
        results.put((statistics.median(reduce_s), p99, statistics.median(copy_s)))
    dist.destroy_process_group()


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "copy"
    if mode not in ("copy", "memmove", "none"):
        raise SystemExit(f"MODE is copy, memmove or none, not {mode!r}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, port, mode, results)) for r in range(2)]
    for p in ranks:
        p.start()
    p50, p99, copy_p50 = results.get(timeout=300)
    for p in ranks:
        p.join(timeout=60)
    policy = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    print(
        f"{mode:8s} OMP_WAIT_POLICY={policy:8s} copy p50 {copy_p50 * 1e6:6.0f} us  "
        f"all_reduce p50 {p50 * 1e6:5.0f} us  p99 {p99 * 1e6:6.0f} us"
    )


if __name__ == "__main__":
    main()
