"""The Cluster message of a 10,000-worker cluster stays within its size budget.

Like torch elastic's ``test_encoded_size_is_within_expected_limit``: the
message every client and worker downloads (GetCluster, WatchCluster) is built
with the coordinator's own code (``Membership`` + ``cluster_to_proto``) for
10,000 registered workers, each with a typical heartbeat status, and must
encode within 4 MB (400 B per worker, see bench/row_coordinator.py). The
typical status has the per-kind rates and latencies of four kinds, the
collective bytes of one, and one client. A new per-worker field that
grows the message past the budget fails here, not at scale.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from collectives.v1 import status_pb2
from collectives_server.coordinator.cluster_message import cluster_to_proto, status_key
from collectives_server.coordinator.membership import Membership

log = logging.getLogger(__name__)

WORKERS = 10_000
BUDGET_BYTES = 4_000_000


def _status(i: int) -> status_pb2.WorkerStatus:
    return status_pb2.WorkerStatus(
        tensors_held=12,
        bytes_held=64 << 20,
        models=["mlp"],
        ops=[
            status_pb2.OpCount(
                kind=k,
                completed=100 + i,
                failed=i % 3,
                rate_per_s=123.4,
                latency_p50_us=1230,
                latency_p99_us=4500,
                collective_bytes_received=(1 << 33) if k == "all_reduce" else 0,
                collective_bytes_sent=(1 << 33) if k == "all_reduce" else 0,
            )
            for k in ("put", "get", "all_reduce", "forward")
        ],
        clients=[
            status_pb2.ClientStatus(
                peer="ipv4:10.200.3.4:54321",
                name="trainer-12",
                user_agent="grpc-python/1.85.1",
                last_unix_time_s=1.7e9 + i,
            )
        ],
        last_op="all_reduce",
        last_op_latency_s=0.0012,
        devices=[
            status_pb2.DeviceStatus(
                device="cpu", memory_used_bytes=(1 << 30) + i, memory_total_bytes=16 << 30
            )
        ],
        package_version="0.1.0",
        torch_version="2.13.0",
        backend_version="gloo",
        bytes_received=1 << 30,
        bytes_sent=1 << 30,
        process_rss_bytes=(2 << 30) + i,
        host_memory_total_bytes=64 << 30,
        host_memory_available_bytes=32 << 30,
        data_collectives=10 + i,
    )


def _address(i: int) -> str:
    return f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:50052"


def _membership_view(workers: int):
    """A real membership of ``workers`` registered, heartbeating, sealed workers."""
    membership = Membership(workers, workers, lease_s=60.0, join_window_s=0.0)
    now = time.monotonic()
    ids = [
        membership.register(
            now,
            address=_address(i),
            hostname=f"node-{i:05d}.cluster.example.com",
            pid=100000 + i,
            devices=("cpu",),
            backend="gloo",
            version="0.1.0",
        )[0]
        for i in range(workers)
    ]
    for i, worker_id in enumerate(ids):
        status = _status(i)
        membership.heartbeat(
            now, worker_id, joined_generation=0, status=status, status_key=status_key(status)
        )
    membership.tick(now + 1.0)
    return membership.view(now + 1.0)


def test_encoded_size_is_within_expected_limit() -> None:
    # Membership's bookkeeping is O(N) per heartbeat (see bench/row_coordinator.py),
    # so a real membership of 10,000 takes minutes: build 100 for real and
    # widen their rows to 10,000, each with its own id, rank, address and status.
    small = _membership_view(100)
    assert small.formed and len(small.workers) == 100
    rows = []
    for i in range(WORKERS):
        row = small.workers[i % 100]
        rows.append(
            dataclasses.replace(
                row,
                worker_id=f"w-{i}",
                rank=i,
                address=_address(i),
                hostname=f"node-{i:05d}.cluster.example.com",
                pid=100000 + i,
                status=_status(i),
                store_port=29500,
            )
        )
    view = dataclasses.replace(small, workers=tuple(rows), world_size=WORKERS)
    msg = cluster_to_proto(view, op_timeout_s=30.0)
    assert len(msg.workers) == WORKERS and msg.store_address.endswith(":29500")
    assert all(w.HasField("status") for w in msg.workers), "statuses must be in the message"
    size = len(msg.SerializeToString())
    assert size <= BUDGET_BYTES, f"{WORKERS} workers encode to {size} B > {BUDGET_BYTES} B"
    log.info(f"Cluster of {WORKERS} workers: {size} B ({size / WORKERS:.0f} B per worker)")
