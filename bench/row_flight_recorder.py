"""The flight recorder's cost: ``cluster.all_reduce`` on a 4-byte tensor, world 2,
with the recorder on (``--flight-recorder-ops 2000``, the default) and off (0).

Both clusters run side by side and are measured in alternating blocks, so a
change of the machine's load hits both alike. Service: the p50 with the
recorder on; anchor: the p50 with it off. Target: on <= 1.02x off (recording
every op costs no more than 2 % of the smallest op).
"""

from __future__ import annotations

import time

import torch

import collectives

from .anchors import percentile
from .core import BenchContext, Row, Stat, shared_cluster

NAME = "flight_recorder"
BLOCKS = 10


def _block(cluster: collectives.Cluster, name: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        cluster.all_reduce(name, op="max")
        out.append((time.perf_counter() - started) * 1e3)
    return out


def run(ctx: BenchContext) -> list[Row]:
    samples = 200 if ctx.quick else 2000
    name = "bench/flight_recorder"
    timings: dict[str, list[float]] = {"on": [], "off": []}
    with (
        collectives.connect(shared_cluster(2), timeout=60) as on,
        collectives.connect(shared_cluster(2, "--flight-recorder-ops", "0"), timeout=60) as off,
    ):
        clusters = {"on": on, "off": off}
        for cluster in clusters.values():
            cluster.put(name, torch.ones(1, dtype=torch.float32))
            _block(cluster, name, max(10, samples // 10))  # warm up
        for _ in range(BLOCKS):
            for key, cluster in clusters.items():
                timings[key].extend(_block(cluster, name, samples // BLOCKS))
        for cluster in clusters.values():
            cluster.delete(name, missing_ok=True)
    on_ms, off_ms = timings["on"], timings["off"]
    on50, off50 = percentile(on_ms, 50), percentile(off_ms, 50)
    return [
        Row(
            group="4 latency",
            what="all_reduce 4 B, world 2, p50, flight recorder on",
            service=Stat(on50, min(on_ms), max(on_ms), "ms", len(on_ms), percentile(on_ms, 99)),
            anchor_name="the same with --flight-recorder-ops 0 (recording off)",
            anchor=Stat(off50, min(off_ms), max(off_ms), "ms", len(off_ms), percentile(off_ms, 99)),
            target="<= 1.02",
            note=(
                f"on p50 {on50:.3g} ms (p99 {percentile(on_ms, 99):.3g}), off p50 {off50:.3g} ms "
                f"(p99 {percentile(off_ms, 99):.3g}); alternating blocks of {samples // BLOCKS}"
            ),
            extra={"samples": samples, "on_p50_ms": on50, "off_p50_ms": off50},
        )
    ]
