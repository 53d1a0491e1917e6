"""Row 1: put and get client <-> worker, against raw TCP loopback into a preallocated buffer.

Rank 0 of the shared local cluster of 2 workers (``shared_cluster(2)``); the
client is this process. Each size is put to rank 0 and read back from it,
``repeats`` times each; the anchor sends the same bytes over
a loopback TCP connection into a preallocated buffer in the same run. The memcpy
figure (``dst.copy_(src)``) of the largest size is in ``extra`` of every row.

Payloads of 1 MiB and more take the workers' bulk port (raw TCP beside gRPC,
see docs/design.md); the "gRPC stream" rows measure the largest size again on a
cluster started with ``--no-bulk``, the path every payload takes under TLS.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

import collectives

from .anchors import TcpSink, memcpy_gbps
from .core import BenchContext, MiB, Row, measure, shared_cluster

NAME = "putget"
TARGET_SIZE = 256 * MiB  # the target: put/get 256 MiB >= 0.6x raw TCP


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB"


def _per_gbps(nbytes: int) -> Callable[[float], float]:
    return lambda seconds: nbytes / seconds / 1e9


def run(ctx: BenchContext) -> list[Row]:
    sizes = ctx.sizes([1 * MiB, 64 * MiB, 256 * MiB], [1 * MiB, 64 * MiB])
    largest = max(sizes)

    def repeats(nbytes: int) -> int:
        if nbytes <= 4 * MiB:
            return 5 if ctx.quick else 20
        return 3 if ctx.quick else ctx.repeats

    memcpy = memcpy_gbps(largest, 5 if ctx.quick else 10)
    anchors = {}
    with TcpSink(largest) as sink:
        for nbytes in sizes:
            t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
            anchors[nbytes] = sink.gbps(t, repeats(nbytes))

    rows: list[Row] = []
    with collectives.connect(shared_cluster(2), timeout=60) as cluster:
        for nbytes in sizes:
            t = torch.randint(0, 255, (nbytes // 4,), dtype=torch.int32).view(torch.float32)
            name = f"bench/putget/{nbytes}"
            n = repeats(nbytes)
            gbps = _per_gbps(nbytes)
            put = measure(partial(cluster.put, name, t, rank=0), n, unit="GB/s", per=gbps)
            get = measure(partial(cluster.get, name, rank=0), n, unit="GB/s", per=gbps)
            back = cluster.get(name, rank=0)
            if not torch.equal(back.view(torch.int32), t.view(torch.int32)):
                raise AssertionError(f"get returned different bytes than put ({_label(nbytes)})")
            if nbytes == largest:
                rows.append(_get_out_row(cluster, name, t, n, anchors[nbytes]))
            cluster.delete(name, missing_ok=True)
            target = ">= 0.6" if nbytes == TARGET_SIZE else ""
            extra = {
                "bytes": nbytes,
                "memcpy_GBps": memcpy.median,
                "memcpy": memcpy.text(),
                "memcpy_bytes": largest,
            }
            for what, stat in (("put", put), ("get", get)):
                note = f"memcpy {memcpy.text()}" if (what, nbytes) == ("put", largest) else ""
                rows.append(
                    _row(f"{what} {_label(nbytes)}", stat, anchors[nbytes], note, extra, target)
                )
    rows += _stream_rows(largest, anchors[largest], repeats(largest))
    return rows


def _row(what: str, stat, anchor, note: str, extra: dict, target: str = "") -> Row:
    """A row of this group, against raw TCP into a preallocated buffer."""
    return Row(
        group="1 put/get",
        what=what,
        service=stat,
        anchor_name="raw TCP loopback, preallocated recv buffer",
        anchor=anchor,
        target=target,
        note=note,
        extra=dict(extra),
    )


def _get_out_row(cluster, name: str, t: torch.Tensor, n: int, anchor) -> Row:
    """get(out=) into one preallocated tensor, as the anchor receives: no target of its
    own (the plain get row carries it); the difference is the fresh buffer's pages."""
    nbytes = t.numel() * t.element_size()
    out = torch.zeros_like(t)  # touched once, as the anchor's buffer is
    stat = measure(
        partial(cluster.get, name, rank=0, out=out), n, unit="GB/s", per=_per_gbps(nbytes)
    )
    if not torch.equal(out.view(torch.int32), t.view(torch.int32)):
        raise AssertionError(f"get(out=) returned different bytes than put ({_label(nbytes)})")
    return _row(
        f"get {_label(nbytes)} into out= (a preallocated tensor)",
        stat,
        anchor,
        "like for like with the anchor: both receive into memory already touched",
        {"bytes": nbytes},
    )


def _stream_rows(nbytes: int, anchor, n: int) -> list[Row]:
    """The largest size through gRPC streams only (a ``--no-bulk`` cluster): no target."""
    t = torch.randint(0, 255, (nbytes // 4,), dtype=torch.int32).view(torch.float32)
    name = f"bench/putget/stream/{nbytes}"
    gbps = _per_gbps(nbytes)
    with collectives.connect(shared_cluster(1, "--no-bulk"), timeout=60) as cluster:
        put = measure(partial(cluster.put, name, t, rank=0), n, unit="GB/s", per=gbps)
        get = measure(partial(cluster.get, name, rank=0), n, unit="GB/s", per=gbps)
        if not torch.equal(cluster.get(name, rank=0).view(torch.int32), t.view(torch.int32)):
            raise AssertionError("stream get returned different bytes than put")
        cluster.delete(name, missing_ok=True)
    return [
        _row(
            f"{what} {_label(nbytes)}, gRPC stream (--no-bulk, as under TLS)",
            stat,
            anchor,
            "bound: grpcio copies each 4 MiB message twice, partly under the GIL",
            {"bytes": nbytes},
        )
        for what, stat in (("put", put), ("get", get))
    ]
