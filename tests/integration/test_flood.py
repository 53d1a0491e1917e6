"""A flood of idle connections leaves a legitimate client's ops right and the daemons well.

Against one worker and the coordinator at once: 64 gRPC streams that send a
header and then nothing (no deadline), 300 idle TCP connections to the bulk
port, and 100 idle HTTP connections to the dashboard (``bench/flood.py``).
Meanwhile a legitimate client runs 200 all_reduces on fresh random data, each
checked against torch. All 200 must succeed and be right, the daemons stay
healthy and their memory comes back (tests/hostile.py). How much the flood
slows the ops is a bench row (``bench/row_flood.py``, ``make bench``): a
latency bound here would be broken by the machine's load, not by the flood.

The ops start once the daemons have taken the whole flood in, as their own
metrics count it: every idle stream admitted, every bulk and dashboard
connection accepted or refused.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time

import grpc
import pytest
import torch
from helpers import wait_until
from hostile import Aftermath, assert_serving
from launcher import free_port, free_port_block
from test_metrics import scrape, value

from bench.flood import idle_sockets, idle_streams, taken_in
from collectives.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(300)

IDLE_STREAMS = 64
IDLE_BULK = 300
IDLE_DASHBOARD = 100
OPS = 200


def _run_ops(client, gen: torch.Generator, members: list, tag: str) -> list[float]:
    """OPS all_reduces of fresh random operands, each checked; their latencies (s)."""
    latencies = []
    for i in range(OPS):
        parts = [torch.randn(64, generator=gen) for _ in members]
        rank = members[i % len(members)].rank  # every rank's result is read in turn
        for w, t in zip(members, parts, strict=True):
            client.put(f"flood/{tag}", t, rank=w.rank)
        started = time.perf_counter()
        client.all_reduce(f"flood/{tag}", out=f"flood/{tag}_sum")
        latencies.append(time.perf_counter() - started)
        torch.testing.assert_close(client.get(f"flood/{tag}_sum", rank=rank), sum(parts))
    return latencies


def _summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    slowest = max(range(len(latencies)), key=latencies.__getitem__)
    return (
        f"p50 {statistics.median(ordered) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
        f"max {ordered[-1] * 1e3:.2f} ms (op #{slowest})"
    )


def _worker_metrics_port(base: int, workers: int, rank: int) -> int:
    """Which of the workers' metrics ports (base+1 .. base+workers) serves ``rank``."""
    for port in range(base + 1, base + workers + 1):
        if value(scrape(port), "collectives_worker_rank") == rank:
            return port
    raise AssertionError(f"no worker on ports {base + 1}..{base + workers} has rank {rank}")


def test_a_flood_of_idle_connections_leaves_collectives_right(fresh_cluster, gen) -> None:
    dashboard, metrics = free_port(), free_port_block(3)
    local, client = fresh_cluster(
        2, "--dashboard-port", str(dashboard), "--metrics-port", str(metrics)
    )
    members = sorted((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
    target = members[-1]
    target_metrics = _worker_metrics_port(metrics, 2, target.rank)
    aftermath = Aftermath(client).capture()
    with grpc.insecure_channel(target.address) as channel:
        bulk_port = int(
            worker_pb2_grpc.WorkerStub(channel)
            .GetDataPlane(worker_pb2.DataPlaneRequest(), timeout=10)
            .bulk_port
        )
    assert bulk_port > 0, "the worker offers no bulk port"

    unloaded = _run_ops(client, gen, members, "unloaded")
    refused0 = value(scrape(target_metrics), "collectives_bulk_connections_refused_total")

    with (
        idle_streams(target.address, IDLE_STREAMS) as streams,
        idle_sockets(bulk_port, IDLE_BULK, first=b"C") as bulk,
        idle_sockets(dashboard, IDLE_DASHBOARD, first=b"GET / HTTP/1.1\r\n") as web,
    ):
        wait_until(
            lambda: taken_in(target_metrics, metrics, len(streams), len(bulk), len(web), refused0),
            10,
            "the daemons to count every connection of the flood",
        )
        errors: queue.Queue[BaseException] = queue.Queue()
        loaded: list[float] = []

        def legit() -> None:
            try:
                loaded.extend(_run_ops(client, gen, members, "loaded"))
            except BaseException as exc:  # reported on the test thread
                errors.put(exc)

        worker = threading.Thread(target=legit, name="legit-client")
        worker.start()
        worker.join(120)
        assert not worker.is_alive(), "the legitimate client did not finish within 120 s"
        if not errors.empty():
            raise errors.get()
        assert_serving(target.address, within_s=1.0)
        assert_serving(local.address, within_s=1.0)
        log.info(
            f"flood: {len(streams)} idle streams, {len(bulk)} bulk and {len(web)} dashboard "
            f"connections held open\n  unloaded {_summary(unloaded)}\n  loaded   {_summary(loaded)}"
        )
    assert len(loaded) == OPS
    aftermath.check()
