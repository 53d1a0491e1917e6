"""The Prometheus endpoints: ``collectives-server local --metrics-port P`` serves the
coordinator's metrics on P and worker i's on P+1+i; each /metrics page parses
with prometheus_client's parser and its counters agree with a scripted workload.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import wait_until
from launcher import free_port_block
from prometheus_client.parser import text_string_to_metric_families

import collectives
import collectives_server

WORKERS = 2


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not exported; have {sorted(k[0] for k in samples)}"
    return samples[key]


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


@pytest.mark.timeout(180)
def test_metrics_agree_with_the_workload(fresh_cluster):
    base = free_port_block(WORKERS + 1)
    _, cluster = fresh_cluster(WORKERS, "--metrics-port", str(base))
    generation = cluster.generation
    x = torch.randn(64, 4)
    cluster.put("m", x)
    all_reduces = 5
    for _ in range(all_reduces):
        cluster.all_reduce("m")
    cluster.broadcast("m", src=1)
    with pytest.raises(collectives.NotFound):
        cluster.all_reduce("absent")
    cluster.get("m", rank=0)

    # --- the coordinator on P --------------------------------------------------
    def quiet():
        # A worker's state is what its last heartbeat said: one sent while the last
        # op ran says busy until the next one arrives.
        samples = scrape(base)
        ready = value(samples, "collectives_workers", state="ready") == WORKERS
        return samples if ready else None

    coordinator = wait_until(quiet, 30, "both workers reported ready after the workload")
    assert value(coordinator, "collectives_generation") == generation
    assert value(coordinator, "collectives_world_size") == WORKERS
    assert value(coordinator, "collectives_cluster_formed") == 1
    assert value(coordinator, "collectives_coordinator_leader") == 1  # the memory store's
    for state in ("joining", "busy", "draining", "lost"):
        assert value(coordinator, "collectives_workers", state=state) == 0
    assert value(coordinator, "collectives_membership_changes_total", reason="joined") == WORKERS
    assert value(coordinator, "collectives_membership_changes_total", reason="lost") == 0
    assert value(coordinator, "collectives_membership_changes_total", reason="left") == 0
    assert value(coordinator, "collectives_heartbeats_received_total") >= WORKERS
    # Exported (a loaded machine may delay the ticker enough to count one).
    assert value(coordinator, "collectives_coordinator_pauses_total") >= 0
    for w in cluster.workers():
        age = value(coordinator, "collectives_worker_heartbeat_age_seconds", worker=w.address)
        assert 0 <= age < 5
    build = [k for k in coordinator if k[0] == "collectives_build_info"]
    assert len(build) == 1 and dict(build[0][1])["version"] == collectives_server.__version__

    # --- worker i on P+1+i: counters equal what was issued -----------------------
    ranks_seen = set()
    for i in range(WORKERS):
        port = base + 1 + i

        def settled(port=port):
            # A follower records an op a moment after the leader answered the client.
            m = scrape(port)
            done = value(m, "collectives_op_latency_seconds_count", kind="all_reduce")
            return m if done == all_reduces + 1 else None

        m = wait_until(settled, 10, f"worker on metrics port {port} to count every op")
        rank = int(value(m, "collectives_worker_rank"))
        ranks_seen.add(rank)
        what = f"worker rank {rank} (metrics port {port})"
        assert value(m, "collectives_worker_generation") == generation, what
        assert value(m, "collectives_ops_total", kind="all_reduce", status="ok") == all_reduces
        assert value(m, "collectives_ops_total", kind="all_reduce", status="not_found") == 1
        assert value(m, "collectives_ops_total", kind="broadcast", status="ok") == 1
        assert value(m, "collectives_ops_total", kind="put", status="ok") == 1
        assert value(m, "collectives_op_latency_seconds_count", kind="all_reduce") == (
            all_reduces + 1
        )
        assert value(m, "collectives_op_latency_seconds_bucket", kind="all_reduce", le="+Inf") == (
            all_reduces + 1
        )
        assert value(m, "collectives_op_latency_seconds_sum", kind="all_reduce") > 0
        nbytes = x.numel() * x.element_size()
        assert value(m, "collectives_bytes_total", direction="received") >= nbytes, what
        sent = value(m, "collectives_bytes_total", direction="sent")
        assert sent == (nbytes if rank == 0 else 0), what
        assert value(m, "collectives_tensors_held") == 1, what
        assert value(m, "collectives_tensors_held_bytes") == nbytes, what
        assert value(m, "collectives_queue_depth") == 0, what
        # Nothing held open between calls (the flood test counts a held flood).
        assert value(m, "collectives_data_streams_active") == 0, what
        assert value(m, "collectives_bulk_connections_refused_total") == 0, what
        assert value(m, "collectives_device_memory_used_bytes", device="cpu") > 0, what
        assert value(m, "collectives_device_memory_total_bytes", device="cpu") > 0, what
        assert value(m, "collectives_models_loaded") == 0, what
        assert value(m, "collectives_data_collectives_total") >= all_reduces + 1, what
        assert value(m, "collectives_gradient_buckets_total") == 0, what
        assert value(m, "collectives_heartbeat_failures_total") == 0, what
        if rank == 0:
            assert value(m, "collectives_ops_total", kind="get", status="ok") == 1, what
        wait_until(
            lambda port=port: value(scrape(port), "collectives_heartbeats_sent_total") >= 1,
            10,
            f"{what} to count heartbeats",
        )
        build = [k for k in m if k[0] == "collectives_build_info"]
        assert dict(build[0][1]) == {
            "version": collectives_server.__version__,
            "torch": torch.__version__,
            "backend": "gloo",
        }
    assert ranks_seen == set(range(WORKERS))


@pytest.mark.timeout(180)
def test_metrics_bind_localhost_by_default(fresh_cluster):
    base = free_port_block(WORKERS + 1)
    fresh_cluster(WORKERS, "--metrics-port", str(base))
    for port in range(base, base + WORKERS + 1):
        addresses = _listening_addresses(port)
        # 0100007F is 127.0.0.1 in /proc/net/tcp's little-endian hex.
        assert addresses == ["0100007F"], (port, addresses)
        assert scrape(port)  # and it answers there
