"""Row 9: put and get to a CUDA worker, against pinned host <-> device ``copy_``.

Runs only where torch sees a CUDA device (elsewhere it is listed as skipped,
with the reason, under the table: CI and the development VM have none). A local cluster of one
worker with ``--devices cuda:0``; the client puts a tensor (it lands in pinned
host memory through the bulk port, then goes to the GPU) and gets it back (GPU
-> pinned host -> bulk port). Anchors in the same run: a pinned host tensor
``copy_``'d to the device and back (the bus, the ceiling of the device leg),
and raw TCP loopback (the ceiling of the network leg).
"""

from __future__ import annotations

from functools import partial

import torch

import collectives

from .anchors import TcpSink
from .core import BenchContext, MiB, Row, Skip, local_cluster, measure

NAME = "gpu"


def _pinned_copy_gbps(nbytes: int, repeats: int, to_device: bool):
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        (dev if to_device else host).copy_(host if to_device else dev, non_blocking=True)
        torch.cuda.synchronize()

    return measure(copy, repeats, warmup=2, unit="GB/s", per=lambda s: nbytes / s / 1e9)


def run(ctx: BenchContext) -> list[Row]:
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device on this machine (no GPU row without one)")
    sizes = ctx.sizes([64 * MiB, 256 * MiB], [64 * MiB])
    repeats = 3 if ctx.quick else ctx.repeats
    rows: list[Row] = []
    with TcpSink(max(sizes)) as sink:
        tcp = {n: sink.gbps(torch.randint(0, 255, (n,), dtype=torch.uint8), repeats) for n in sizes}
    with (
        local_cluster(1, "--devices", "cuda:0") as address,
        collectives.connect(address, timeout=120) as cluster,
    ):
        for nbytes in sizes:
            t = torch.randint(0, 255, (nbytes // 4,), dtype=torch.int32).view(torch.float32)
            name = f"bench/gpu/{nbytes}"

            def gbps(seconds: float, nbytes: int = nbytes) -> float:
                return nbytes / seconds / 1e9

            put = measure(partial(cluster.put, name, t, rank=0), repeats, unit="GB/s", per=gbps)
            get = measure(partial(cluster.get, name, rank=0), repeats, unit="GB/s", per=gbps)
            if not torch.equal(cluster.get(name, rank=0).view(torch.int32), t.view(torch.int32)):
                raise AssertionError("a CUDA worker returned different bytes than were put")
            cluster.delete(name, missing_ok=True)
            h2d = _pinned_copy_gbps(nbytes, repeats, to_device=True)
            d2h = _pinned_copy_gbps(nbytes, repeats, to_device=False)
            for what, stat, bus in (("put", put, h2d), ("get", get, d2h)):
                rows.append(
                    Row(
                        group="9 GPU worker",
                        what=f"{what} {nbytes // MiB} MiB to/from a cuda:0 worker",
                        service=stat,
                        anchor_name="raw TCP loopback (the network leg's ceiling)",
                        anchor=tcp[nbytes],
                        note=f"pinned {'H2D' if what == 'put' else 'D2H'} copy_ {bus.text()}",
                        extra={"bytes": nbytes, "pinned_copy_GBps": bus.median},
                    )
                )
    return rows
