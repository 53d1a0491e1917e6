"""Row 4: small-op latency of ``cluster.all_reduce`` on a 4-byte tensor, world 2.

Service: p50 (and p99, in the note) over many single all_reduces from this
process. Anchor, measured in the same run: one empty gRPC round trip to a
worker (``grpc.health.v1`` Check, p50) plus twice a direct gloo all_reduce of
4 bytes (p50) in two fresh processes. Target: service p50 <= 1.0x the anchor.
"""

from __future__ import annotations

import collectives

from .anchors import all_reduce_seconds, gloo_all_reduce, grpc_empty_rtt, percentile
from .core import BenchContext, Row, Stat, shared_cluster

NAME = "latency"


def _ms(values: list[float]) -> list[float]:
    return [v * 1e3 for v in values]


def run(ctx: BenchContext) -> list[Row]:
    samples = 100 if ctx.quick else 1000
    with collectives.connect(shared_cluster(2), timeout=60) as cluster:
        service = all_reduce_seconds(cluster, "bench/latency", samples)
        worker = next(w for w in cluster.workers() if w.rank == 0)
        rtt = grpc_empty_rtt(worker.address, samples)
    gloo = gloo_all_reduce(4, samples)

    service_ms, rtt_ms, gloo_ms = _ms(service), _ms(rtt), _ms(gloo)
    p50 = percentile(service_ms, 50)
    p99 = percentile(service_ms, 99)
    rtt50, gloo50 = percentile(rtt_ms, 50), percentile(gloo_ms, 50)
    anchor = Stat(
        median=rtt50 + 2 * gloo50,
        low=min(rtt_ms) + 2 * min(gloo_ms),
        high=max(rtt_ms) + 2 * max(gloo_ms),
        unit="ms",
        samples=samples,
    )
    return [
        Row(
            group="4 latency",
            what="all_reduce 4 B, world 2, p50",
            service=Stat(p50, min(service_ms), max(service_ms), "ms", samples, p99),
            anchor_name="gRPC empty RTT p50 + 2x direct gloo 4 B all_reduce p50",
            anchor=anchor,
            target="<= 1.0",
            note=(
                f"p99 {p99:.3g} ms; anchor parts: gRPC RTT p50 {rtt50:.3g} ms "
                f"(p99 {percentile(rtt_ms, 99):.3g}), gloo 4 B p50 {gloo50:.3g} ms "
                f"(p99 {percentile(gloo_ms, 99):.3g})"
            ),
            extra={
                "samples": samples,
                "service_p50_ms": p50,
                "service_p99_ms": p99,
                "grpc_rtt_p50_ms": rtt50,
                "grpc_rtt_p99_ms": percentile(rtt_ms, 99),
                "gloo_4B_p50_ms": gloo50,
                "gloo_4B_p99_ms": percentile(gloo_ms, 99),
            },
        )
    ]
