"""The operator's view on a real cluster: per op kind, collective bytes, errors, clients.

A named client (``COLLECTIVES_CLIENT_NAME``) runs a known workload on 2 workers;
each worker's reported status (through the coordinator), the cluster's
aggregation and the Prometheus endpoints must agree with what it did: counts
exactly, latency percentiles within what the client measured, collective bytes
as ``collectives_server.worker.telemetry.collective_traffic`` documents them (an all_reduce
of n bytes at world size 2 moves n in and n out on each rank; a broadcast moves
n out of the root and n into the other rank), the failing ops as one group with
a count, first/last time, a rate and the client, and the client in the list.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import wait_until
from launcher import free_port_block
from test_metrics import scrape, value

import collectives
from collectives.cli.main import format_table
from collectives.wire.cluster_state import ClusterSnapshot

WORKERS = 2
ALL_REDUCES = 40
BROADCASTS = 3
FAILURES = 5
NBYTES = 4096  # 1024 float32


@pytest.mark.timeout(180)
def test_per_kind_rates_bytes_errors_and_clients(fresh_cluster, monkeypatch, uname):
    base = free_port_block(WORKERS + 1)
    local, _ = fresh_cluster(WORKERS, "--metrics-port", str(base))
    # Named after the cluster started, so only this client carries the name.
    monkeypatch.setenv("COLLECTIVES_CLIENT_NAME", "ops-test")
    client = collectives.connect(local.address, timeout=30)
    try:
        _run(client, base, uname)
    finally:
        client.close()


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _run(client, base: int, uname) -> None:
    x, missing = uname("x"), uname("missing")
    client.put(x, torch.arange(NBYTES // 4, dtype=torch.float32))
    latencies = [_timed(lambda: client.all_reduce(x)) for _ in range(ALL_REDUCES)]
    for _ in range(BROADCASTS):
        client.broadcast(x, src=1)
    for _ in range(FAILURES):
        with pytest.raises(collectives.NotFound):
            client.all_reduce(missing)
    done_at = time.time()

    def settled() -> ClusterSnapshot | None:
        snap = client.refresh()
        ok = all(
            w.ops.get("all_reduce") is not None
            and (w.ops["all_reduce"].completed, w.ops["all_reduce"].failed)
            == (ALL_REDUCES, FAILURES)
            and w.ops.get("broadcast") is not None
            and w.ops["broadcast"].completed == BROADCASTS
            and w.clients
            for w in snap.members
        )
        return snap if ok and len(snap.members) == WORKERS else None

    snap = wait_until(settled, 20, "every worker's status to count the workload")

    slowest = max(latencies)
    for w in snap.members:
        what = f"rank {w.rank}"
        ar = w.ops["all_reduce"]
        # The rate covers completed and failed ops of the last ~10 s (at least 1 s).
        assert 0 < ar.rate_per_s <= ALL_REDUCES + FAILURES, (what, ar)
        # Each op's worker latency lies inside the client's call.
        assert 0 < ar.latency_p50_s <= ar.latency_p99_s <= slowest + 0.05, (what, ar, slowest)
        assert ar.latency_p50_s <= statistics.median(latencies) * 2 + 0.01, (what, ar)
        # Bytes: the traffic model, exactly; a failed op moves nothing.
        assert ar.collective_bytes_received == ar.collective_bytes_sent == ALL_REDUCES * NBYTES
        bc = w.ops["broadcast"]
        root = w.rank == 1
        expected = (0, BROADCASTS * NBYTES) if root else (BROADCASTS * NBYTES, 0)
        assert (bc.collective_bytes_received, bc.collective_bytes_sent) == expected, what
        assert w.collective_bytes_received == ar.collective_bytes_received + expected[0]
        assert w.collective_bytes_sent == ar.collective_bytes_sent + expected[1]
        # The data plane counts the put apart.
        assert w.bytes_received == NBYTES, what

    # The cluster's row per kind: a collective counted once (not once per rank).
    total = snap.ops_by_kind()["all_reduce"]
    assert (total.completed, total.failed) == (ALL_REDUCES, FAILURES)
    assert total.collective_bytes_received == WORKERS * ALL_REDUCES * NBYTES

    # The five failures are one group on the cluster, with the client that issued them.
    groups = [g for g in snap.error_groups() if g.group.message.find(missing) >= 0]
    assert len(groups) == 1, snap.error_groups()
    g = groups[0].group
    assert (g.kind, g.code, g.count) == ("all_reduce", "NOT_FOUND", FAILURES)
    assert g.first_unix_time_s <= g.last_unix_time_s <= done_at + 1
    assert g.rate_per_s > 0 and g.last_op_id > 0
    assert g.client.startswith("ops-test (ipv"), g.client
    assert groups[0].ranks == tuple(range(WORKERS))
    table = format_table("coordinator", snap, width=10_000)
    assert f"{FAILURES}x all_reduce NOT_FOUND: {g.message}" in table, table
    assert f"last op {g.last_op_id}, client ops-test (ipv" in table, table

    # The client is listed by name, with its user agent, on both workers.
    named = [c for c in snap.clients() if c.name == "ops-test"]
    assert len(named) == 1, snap.clients()
    assert named[0].user_agent.startswith("grpc-python/"), named[0].user_agent
    assert len(named[0].workers) == WORKERS

    # Prometheus: the collective bytes by kind and direction, the clients gauge.
    for i in range(WORKERS):
        m = scrape(base + 1 + i)
        rank = int(value(m, "collectives_worker_rank"))
        for direction in ("received", "sent"):
            moved = value(m, "collectives_collective_bytes_total", kind="all_reduce",
                          direction=direction)  # fmt: skip
            assert moved == ALL_REDUCES * NBYTES, (rank, direction)
        sent = value(m, "collectives_collective_bytes_total", kind="broadcast", direction="sent")
        assert sent == (BROADCASTS * NBYTES if rank == 1 else 0)
        assert value(m, "collectives_clients_connected") >= 1
        assert value(m, "collectives_error_groups") >= 1


def _top(address: str, *flags: str, columns: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "collectives.cli.main", "top", "--coordinator", address,
         "--iterations", "1", *flags],
        capture_output=True, text=True, timeout=60, check=False,
        env=dict(os.environ, COLUMNS=columns),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.replace("\x1b[H\x1b[2J", "")


@pytest.mark.timeout(120)
def test_top_piped_has_the_rates_in_its_first_frame_and_honours_columns_and_wide(
    cluster2_address, cluster2, uname
):
    name = uname("top")
    cluster2.put(name, torch.ones(256))
    for _ in range(20):
        cluster2.all_reduce(name)
    wait_until(
        lambda: all(w.ops.get("all_reduce") for w in cluster2.refresh().members),
        20,
        "the workers to report all_reduce",
    )
    narrow = _top(cluster2_address, columns="70").splitlines()
    assert max(map(len, narrow)) <= 70, narrow
    # The rate covers the last ~10 s: keep all_reduces going while top starts, however
    # long a loaded machine takes to start it.
    stop = threading.Event()

    def keep_reducing() -> None:
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            cluster2.all_reduce(name)

    busy = threading.Thread(target=keep_reducing)
    busy.start()
    try:
        # One frame: the by-kind table already has all_reduce's rate (the workers' own,
        # from their last heartbeats). A frame drawn before any heartbeat carried the
        # running rate may read 0.0 on a loaded machine: another top then, a few at most.
        for _ in range(5):
            wide = _top(cluster2_address, "--wide", columns="70")
            row = next(line.split() for line in wide.splitlines() if line.startswith("all_reduce"))
            if float(row[2]) > 0:
                break
    finally:
        stop.set()
        busy.join(timeout=60)
    assert "…" not in wide and max(map(len, wide.splitlines())) > 70, wide
    assert row[1] == "all" and float(row[2]) > 0, row
    assert {"P50", "P99", "COLL_IN", "COLL_OUT"} <= set(wide.split())
    cluster2.delete(name, missing_ok=True)
