"""Row: a flood of idle connections does not slow a legitimate client down.

A cluster of 2 workers with a dashboard and metrics ports. The same client runs
the same all_reduces of 64 random floats (each with fresh puts first, only the
all_reduce timed) twice: unloaded (the anchor), then while one worker and the
coordinator hold a flood open: 64 idle PutTensor streams, 300 idle TCP
connections to the bulk port, 100 idle HTTP connections to the dashboard
(``bench/flood.py``). Timing starts once the daemons' own metrics count every
connection of the flood. Target: loaded p50 <= 2x unloaded p50; the worst op
of each is in the note. tests/integration/test_flood.py checks that every op
under the flood is right and the daemons come back to health.
"""

from __future__ import annotations

import random
import socket
import time

import grpc
import torch

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc

from .anchors import percentile
from .core import BenchContext, Row, Stat, local_cluster
from .flood import idle_sockets, idle_streams, metric, scrape, taken_in

NAME = "flood"
IDLE_STREAMS, IDLE_BULK, IDLE_DASHBOARD = 64, 300, 100
TARGET = 2.0
_TAKEN_IN_S = 30.0


def _free_ports(count: int) -> int:
    """A base port P with P .. P+count-1 free on 127.0.0.1 (below the ephemeral range)."""
    for _ in range(200):
        base = random.randrange(10000, 30000)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no block of {count} free ports")


def _all_reduces(cluster: collectives.Cluster, members: list, ops: int, tag: str) -> list[float]:
    """Seconds per all_reduce of fresh random operands (puts not timed)."""
    seconds = []
    for _ in range(ops):
        for w in members:
            cluster.put(f"bench/flood/{tag}", torch.randn(64), rank=w.rank)
        started = time.perf_counter()
        cluster.all_reduce(f"bench/flood/{tag}")
        seconds.append(time.perf_counter() - started)
    cluster.delete(f"bench/flood/{tag}", missing_ok=True)
    return seconds


def _stat(seconds: list[float]) -> Stat:
    ms = [s * 1e3 for s in seconds]
    return Stat(percentile(ms, 50), min(ms), max(ms), "ms", len(ms), percentile(ms, 99))


def run(ctx: BenchContext) -> list[Row]:
    ops = 100 if ctx.quick else 400
    dashboard, metrics = _free_ports(1), _free_ports(3)
    flags = ("--dashboard-port", str(dashboard), "--metrics-port", str(metrics))
    with (
        local_cluster(2, *flags) as address,
        collectives.connect(address, timeout=60) as cluster,
    ):
        members = sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)
        target = members[-1]
        target_metrics = next(
            port
            for port in (metrics + 1, metrics + 2)
            if metric(scrape(port), "collectives_worker_rank") == target.rank
        )
        with grpc.insecure_channel(target.address) as channel:
            plane = worker_pb2_grpc.WorkerStub(channel).GetDataPlane(
                worker_pb2.DataPlaneRequest(), timeout=10
            )
        _all_reduces(cluster, members, ops // 4, "warm")
        unloaded = _all_reduces(cluster, members, ops, "unloaded")
        refused0 = metric(scrape(target_metrics), "collectives_bulk_connections_refused_total")
        with (
            idle_streams(target.address, IDLE_STREAMS) as streams,
            idle_sockets(plane.bulk_port, IDLE_BULK, first=b"C") as bulk,
            idle_sockets(dashboard, IDLE_DASHBOARD, first=b"GET / HTTP/1.1\r\n") as web,
        ):
            deadline = time.monotonic() + _TAKEN_IN_S
            while True:  # the daemons counting the flood: a condition with a deadline
                try:
                    taken_in(target_metrics, metrics, len(streams), len(bulk), len(web), refused0)
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            loaded = _all_reduces(cluster, members, ops, "loaded")
    service, anchor = _stat(loaded), _stat(unloaded)
    return [
        Row(
            group="flood",
            what=f"all_reduce 256 B, world 2, under {IDLE_STREAMS} idle streams, "
            f"{len(bulk)} bulk and {len(web)} dashboard connections, p50",
            service=service,
            anchor_name="the same all_reduces unloaded, same client, same run",
            anchor=anchor,
            target=f"<= {TARGET}",
            note=f"worst op {service.high:.2f} ms loaded vs {anchor.high:.2f} ms unloaded",
        )
    ]
