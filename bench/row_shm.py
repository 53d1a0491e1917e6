"""Row 2: put and get through shared memory, against raw TCP loopback and memcpy.

A client on the worker's host connected with ``shared_memory=True``: the payload
goes through a file in ``/dev/shm`` and only a handle goes over gRPC (a put is
the client's copy into a pooled segment, which a worker of the same user keeps
the tensor in; a get is the worker's copy into a pooled segment). One local
worker; each size is put to rank 0 and read back, ``repeats`` times. The
anchors, in the same run: raw TCP loopback into a preallocated buffer (the
ratio's anchor, target >= 1.5x) and ``dst.copy_(src)`` memcpy (in ``extra`` and
the note: the ceiling, since each direction costs at least one memcpy into
tmpfs).
"""

from __future__ import annotations

from functools import partial

import torch

import collectives
from collectives.wire import shm

from .anchors import TcpSink, memcpy_gbps
from .core import BenchContext, MiB, Row, local_cluster, measure

NAME = "shm"
TARGET = ">= 1.5"  # the target: shared-memory put/get >= 1.5x raw TCP


def run(ctx: BenchContext) -> list[Row]:
    if not shm.available():
        return []
    sizes = ctx.sizes([64 * MiB, 256 * MiB], [64 * MiB])
    largest = max(sizes)
    repeats = 5 if ctx.quick else max(ctx.repeats, 7)

    memcpy = {n: memcpy_gbps(n, repeats) for n in sizes}
    anchors = {}
    with TcpSink(largest) as sink:
        for nbytes in sizes:
            t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
            anchors[nbytes] = sink.gbps(t, repeats)

    rows: list[Row] = []
    with (
        local_cluster(1) as address,
        collectives.connect(address, timeout=60, shared_memory=True) as cluster,
    ):
        for nbytes in sizes:
            t = torch.randint(0, 255, (nbytes // 4,), dtype=torch.int32).view(torch.float32)
            name = f"bench/shm/{nbytes}"

            def gbps(seconds: float, nbytes: int = nbytes) -> float:
                return nbytes / seconds / 1e9

            put = measure(
                partial(cluster.put, name, t, rank=0), repeats, warmup=2, unit="GB/s", per=gbps
            )
            get = measure(partial(cluster.get, name, rank=0), repeats, unit="GB/s", per=gbps)
            back = cluster.get(name, rank=0)
            if not torch.equal(back.view(torch.int32), t.view(torch.int32)):
                raise AssertionError(f"shm get returned different bytes ({nbytes // MiB} MiB)")
            cluster.delete(name, missing_ok=True)
            for what, stat in (("put", put), ("get", get)):
                rows.append(
                    Row(
                        group="2 shared memory",
                        what=f"shm {what} {nbytes // MiB} MiB",
                        service=stat,
                        anchor_name="raw TCP loopback, preallocated recv buffer",
                        anchor=anchors[nbytes],
                        target=TARGET,
                        note=f"memcpy {memcpy[nbytes].text()}",
                        extra={
                            "bytes": nbytes,
                            "memcpy_GBps": memcpy[nbytes].median,
                            "vs_memcpy": stat.median / memcpy[nbytes].median,
                        },
                    )
                )
    return rows
