"""Point to point: the service's ``send`` against a direct gloo send/recv pair.

The service side runs on the shared 2-worker cluster: the operand is put on
rank 0 first, then only ``cluster.send(name, src=0, dst=1, out=...)`` is timed,
as the SDK client sees it (the leader's announcement, the operand exchange,
gloo send/recv, the outcome agreement, the commit, the leader's answer). The
anchor is a gloo send plus a 1-byte acknowledgement between 2 fresh processes
built like the workers' groups (bench/direct_p2p.py), measured in the same run.
"""

from __future__ import annotations

import torch

import collectives
from bench.core import BenchContext, MiB, Row, measure, shared_cluster, stat_of
from bench.direct_p2p import run_direct_send

__all__ = ["run"]


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes} B"


def _service(nbytes: int, repeats: int):
    with collectives.connect(shared_cluster(2), timeout=60.0) as cluster:
        cluster.put("bench/p2p", torch.ones(max(1, nbytes), dtype=torch.uint8), rank=0)

        def send() -> None:
            cluster.send("bench/p2p", src=0, dst=1, out="bench/p2p-in")

        try:
            return measure(send, repeats, warmup=1)
        finally:  # the cluster is shared with other rows
            for name in ("bench/p2p", "bench/p2p-in"):
                cluster.delete(name, missing_ok=True)


def run(ctx: BenchContext) -> list[Row]:
    rows = []
    for nbytes in ctx.sizes([64 * MiB], [1 * MiB]):
        anchor = run_direct_send(nbytes, ctx.repeats)
        service = _service(nbytes, ctx.repeats)
        rows.append(
            Row(
                group="p2p",
                what=f"send {_label(nbytes)} world 2",
                service=service,
                anchor_name="direct gloo send/recv pair, 2 processes",
                anchor=stat_of(anchor, "s"),
                note="anchor: send + 1-byte ack, so both sides time a delivered message"
                + (" (quick mode measures 1 MiB)" if nbytes != 64 * MiB else ""),
                extra={"world": 2, "bytes": nbytes, "op": "send"},
            )
        )
    return rows
