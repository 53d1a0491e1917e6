"""A drain's handoff: a rank's tensors moved worker to worker, against loopback TCP.

A local cluster of 1 member and 1 live spare (``--spares 1``): rank 0 holds
``tensors`` tensors of ``total`` bytes in all; each round drains rank 0
(``cluster.drain``), so the spare copies them from it and takes the rank, and the
drained worker restarts as the next spare. The rate is the report's
``bytes_moved / copy_seconds``: the transfer, worker to worker (a manifest over
gRPC, each tensor's ticket over gRPC, its bytes over the bulk connection into
fresh memory). The note gives the whole handoff as the coordinator times it,
from the seal to the successor's report (the drained worker finishing its last
op and closing its store included). The anchor sends the same bytes over one raw
loopback TCP connection into a preallocated buffer, in the same run; a second row
sets the same transfer beside TCP into a new buffer each time, which pays the
page faults of fresh memory as the successor does.
Both anchors are measured between the drains, with the cluster up (its idle
daemons, the drained worker's restart), so that each figure and its anchor meet
the same machine. Every round checks the values on the new holder of the rank.
"""

from __future__ import annotations

import grpc
import torch

import collectives
from collectives.session import drains
from collectives.v1 import coordinator_pb2_grpc

from .anchors import TcpSink
from .core import BenchContext, MiB, Row, local_cluster, stat_of

NAME = "handoff"
GROUP = "7c drain handoff"


def run(ctx: BenchContext) -> list[Row]:
    rounds = 2 if ctx.quick else 10
    tensors = 8
    each = (8 if ctx.quick else 32) * MiB
    total = tensors * each
    gen = torch.Generator().manual_seed(7)
    held = {
        f"bench/handoff/{i}": torch.randint(
            0, 1 << 30, (each // 4,), dtype=torch.int32, generator=gen
        )
        for i in range(tensors)
    }
    payload = torch.cat([t.view(torch.uint8) for t in held.values()])
    flags = ("--spares", "1", "--max-restarts", "0", "--devices", "cpu", "--heartbeat", "0.2")
    rates: list[float] = []
    seconds: list[float] = []
    preallocated: list[float] = []
    fresh: list[float] = []
    with (
        local_cluster(1, *flags) as address,
        collectives.connect(address, timeout=60) as cluster,
        grpc.insecure_channel(address) as channel,
        TcpSink(total) as sink,
        TcpSink(total, fresh=True) as fresh_sink,
    ):
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for name, t in held.items():
            cluster.put(name, t, rank=0)
        for _ in range(rounds):
            # The drained worker of the round before comes back as the next spare.
            drains.wait_for(stub, drains.has_spare, 60, "live spare")
            report = cluster.drain(cluster.workers()[0].address, timeout=120)
            if report.bytes_moved != total or report.tensors_moved != tensors:
                raise AssertionError(f"the handoff moved {report}, not {tensors} tensors")
            for name, t in held.items():
                if not torch.equal(cluster.get(name, rank=0), t):
                    raise AssertionError(f"{name} differs on the successor")
            rates.append(report.bytes_moved / report.copy_seconds / 1e9)
            seconds.append(report.seconds)
            preallocated.append(sink.gbps(payload, 2).median)
            fresh.append(fresh_sink.gbps(payload, 2).median)
    anchor, fresh_anchor = stat_of(preallocated, "GB/s"), stat_of(fresh, "GB/s")
    handoff = stat_of(seconds, "s")
    note = (
        f"{rounds} drains of a rank holding {tensors} x {each // MiB} MiB; handoff "
        f"p50 {handoff.median * 1000:.0f} ms, p99 {(handoff.p99 or 0) * 1000:.0f} ms"
    )
    rate = stat_of(rates, "GB/s")
    return [
        Row(
            group=GROUP,
            what=f"drain: {total // MiB} MiB of a rank's tensors to the spare",
            service=rate,
            anchor_name="raw TCP loopback, preallocated recv buffer",
            anchor=anchor,
            target=">= 0.8",
            note=note,
        ),
        Row(
            group=GROUP,
            what="the same, against loopback TCP into fresh memory (what keeping it costs)",
            service=rate,
            anchor_name="raw TCP loopback, a new recv buffer each transfer",
            anchor=fresh_anchor,
            note="the successor keeps what it receives: its pages are new, as here",
        ),
    ]
