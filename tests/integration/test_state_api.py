"""The state API after a scripted workload: every field of every worker's status,
as the coordinator reports it (``cluster.workers()``, fed by WatchCluster) and
as the worker itself answers GetState, checked against what the workload did.

The cluster is this test's own (``fresh_cluster``), so the counts are exact.
"""

from __future__ import annotations

import re
import socket
import time

import grpc
import pytest
import torch
from helpers import LEASE_S, wait_until

import collectives
import collectives_server
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire.cluster_state import OpCount

STATUS_WAIT_S = 15.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _get_state(address: str) -> worker_pb2.GetStateResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetState(
            worker_pb2.GetStateRequest(), timeout=10
        )


def _by_rank(cluster) -> dict[int, collectives.WorkerInfo]:
    return {w.rank: w for w in cluster.workers() if w.rank >= 0}


@pytest.mark.timeout(180)
def test_worker_status_matches_the_workload(fresh_cluster):
    started = time.time()
    local, cluster = fresh_cluster(2)
    generation = cluster.generation

    # --- the workload ---------------------------------------------------------
    a = torch.arange(32, dtype=torch.float32).reshape(4, 8)  # on both ranks
    b = torch.arange(10, dtype=torch.int64)  # rank 0 only
    c = torch.ones(10, dtype=torch.float32)  # rank 1, deleted again
    cluster.put("a", a)
    cluster.put("b", b, rank=0)
    cluster.put("c", c, rank=1)
    for _ in range(3):
        cluster.all_reduce("a")
    cluster.broadcast("a", src=0)
    cluster.reduce_scatter("a", out="rs")  # each rank keeps a (2, 8) float32 chunk
    cluster.barrier()
    cluster.get("a", rank=1)
    cluster.delete("c", rank=1)
    with pytest.raises(collectives.NotFound) as failed:
        cluster.all_reduce("missing")
    cluster.all_reduce("a")  # the last op everywhere

    rs_bytes = _nbytes(a) // 2
    expected = {
        0: {
            "ops": {
                "all_reduce": OpCount(4, 1),
                "broadcast": OpCount(1, 0),
                "reduce_scatter": OpCount(1, 0),
                "barrier": OpCount(1, 0),
                "put": OpCount(2, 0),
            },
            "tensors": 3,  # a, b, rs
            "bytes_held": _nbytes(a) + _nbytes(b) + rs_bytes,
            "received": _nbytes(a) + _nbytes(b),
            "sent": 0,
        },
        1: {
            "ops": {
                "all_reduce": OpCount(4, 1),
                "broadcast": OpCount(1, 0),
                "reduce_scatter": OpCount(1, 0),
                "barrier": OpCount(1, 0),
                "put": OpCount(2, 0),
                "get": OpCount(1, 0),
                "delete": OpCount(1, 0),
            },
            "tensors": 2,  # a, rs
            "bytes_held": _nbytes(a) + rs_bytes,
            "received": _nbytes(a) + _nbytes(c),
            "sent": _nbytes(a),
        },
    }

    # --- the coordinator's view catches up within a heartbeat ------------------
    def counts(ops: dict[str, OpCount]) -> dict[str, tuple[int, int]]:
        """Completed and failed per kind (rates and percentiles move with time)."""
        return {kind: (c.completed, c.failed) for kind, c in ops.items()}

    def caught_up():
        workers = _by_rank(cluster)
        return len(workers) == 2 and all(
            counts(workers[r].ops) == counts(expected[r]["ops"])
            and workers[r].last_op == "all_reduce"
            for r in (0, 1)
        )

    wait_until(caught_up, STATUS_WAIT_S, f"worker statuses matching {expected}")
    workers = _by_rank(cluster)
    message = failed.value.message
    op_match = re.search(r"\bop (\d+)\b", message)
    for rank, want in expected.items():
        w = workers[rank]
        what = f"rank {rank} ({w.address})"
        assert w.has_status, what
        assert w.state == "ready" and w.generation == generation, what
        assert w.hostname == socket.gethostname() and local.owns(w.pid), what
        assert 0 < w.uptime_s < time.time() - started + 1, (what, w.uptime_s)
        assert 0 <= w.last_heartbeat_age_s < LEASE_S, (what, w.last_heartbeat_age_s)
        assert w.tensors_held == want["tensors"], (what, w.tensors_held)
        assert w.bytes_held == want["bytes_held"], (what, w.bytes_held)
        assert w.bytes_received == want["received"], (what, w.bytes_received)
        assert w.bytes_sent == want["sent"], (what, w.bytes_sent)
        assert w.ops_completed == sum(c.completed for c in want["ops"].values())
        assert w.ops_failed == 1, what
        assert w.last_op == "all_reduce" and 0 < w.last_op_latency_s < 10, (what, w.last_op)
        assert w.queue_depth == 0, what
        assert w.models == (), what
        # Versions are the installed ones; gloo's is torch's own.
        assert w.package_version == collectives_server.__version__, what
        assert w.torch_version == torch.__version__, what
        assert w.backend == "gloo" and w.backend_version == torch.__version__, what
        # Memory: the process's RSS on the host (cpu devices).
        assert [d.device for d in w.device_memory] == ["cpu"], what
        memory = w.device_memory[0]
        assert 0 < memory.used_bytes < memory.total_bytes, (what, memory)
        assert w.process_rss_bytes > 0 and w.host_memory_total_bytes == memory.total_bytes
        assert 0 < w.host_memory_available_bytes <= w.host_memory_total_bytes, what
        # Every data collective on the group counts (one per op here).
        assert w.data_collectives >= 6, (what, w.data_collectives)
        assert w.gradient_buckets_reduced == 0 and w.graphs_retained == 0, what
        # The failed op, findable by the id and message the client got.
        assert len(w.recent_errors) == 1, (what, w.recent_errors)
        error = w.recent_errors[0]
        assert error.kind == "all_reduce" and error.code == "NOT_FOUND", (what, error)
        assert error.generation == generation and error.op_id > 0, (what, error)
        assert error.message in message or message in error.message, (what, error, message)
        if op_match:
            assert error.op_id == int(op_match.group(1)), (what, error, message)
        assert started - 1 <= error.unix_time_s <= time.time(), (what, error)
    # Both ranks ran the same op: the same op id everywhere.
    assert workers[0].recent_errors[0].op_id == workers[1].recent_errors[0].op_id

    # --- the generation history ------------------------------------------------
    history = cluster.history()
    assert history and history[-1].generation == generation, history
    record = history[-1]
    assert record.world_size == 2
    assert list(record.members) == [workers[0].address, workers[1].address]
    assert f"sealed generation {generation}" in record.reason, record.reason
    assert started - 60 <= record.sealed_unix_time_s <= time.time(), record

    # --- GetState on each worker agrees with the coordinator -------------------
    for rank, w in workers.items():
        state = _get_state(w.address)
        assert state.rank == rank and state.generation == generation
        assert state.is_leader == (rank == 0)
        assert state.address == w.address and state.hostname == w.hostname
        assert state.pid == w.pid and state.uptime_s > 0
        assert (state.tensors_held, state.bytes_held) == (w.tensors_held, w.bytes_held)
        assert state.ops_completed == w.ops_completed and state.ops_failed == 1
        direct = collectives.WorkerInfo.from_proto(
            _as_worker_info(w.address, state)
        )  # the same conversion the SDK applies to the coordinator's copy
        for field in (
            "tensors_held", "bytes_held", "models", "ops", "last_op", "queue_depth",
            "package_version", "torch_version", "backend_version", "bytes_received",
            "bytes_sent", "recent_errors", "data_collectives", "gradient_buckets_reduced",
        ):  # fmt: skip
            assert getattr(direct, field) == getattr(w, field), (rank, field)
        assert [d.device for d in direct.device_memory] == ["cpu"]


def _as_worker_info(address: str, state: worker_pb2.GetStateResponse):
    from collectives.v1 import coordinator_pb2

    return coordinator_pb2.WorkerInfo(address=address, rank=state.rank, status=state.status)


@pytest.mark.timeout(180)
def test_status_changes_are_pushed_to_watchers(fresh_cluster):
    """A status change reaches the SDK's watch (no GetCluster poll) within a heartbeat."""
    _, cluster = fresh_cluster(2)
    before = cluster.snapshot().version
    cluster.put("pushed", torch.zeros(16), rank=1)

    def pushed():
        w = _by_rank(cluster)[1]
        return w.tensors_held == 1 and w.bytes_held == 64

    wait_until(pushed, STATUS_WAIT_S, "the put to appear in the watched status")
    assert cluster.snapshot().version > before


@pytest.mark.timeout(180)
def test_model_fields_of_the_status(fresh_cluster):
    """Models loaded, graphs retained and gradient buckets reduced reach the status."""
    from torch import nn

    _, cluster = fresh_cluster(2)
    model = nn.Linear(4, 3)
    cluster.load_model("status-mlp", model, example_inputs=(torch.randn(2, 4),))
    dp = cluster.data_parallel("status-mlp")
    out = dp(torch.randn(6, 4))  # grad enabled: each worker retains its graph

    def graphs_retained():
        workers = _by_rank(cluster)
        return all(
            workers[r].models == ("status-mlp",) and workers[r].graphs_retained == 1 for r in (0, 1)
        )

    wait_until(graphs_retained, STATUS_WAIT_S, "a model and a retained graph on each worker")
    out.sum().backward()
    cluster.all_reduce_gradients("status-mlp")

    def reduced():
        # Status is sampled per heartbeat, possibly mid-op (counters already
        # moved, the op not yet counted): wait for the finished state.
        workers = _by_rank(cluster)
        return all(
            workers[r].gradient_buckets_reduced >= 1
            and workers[r].graphs_retained == 0
            and workers[r].ops.get("all_reduce_gradients", OpCount()).completed == 1
            for r in (0, 1)
        )

    wait_until(reduced, STATUS_WAIT_S, "gradient buckets reduced, op counted, graphs released")
    for w in _by_rank(cluster).values():
        assert w.data_collectives >= w.gradient_buckets_reduced, w
        assert w.ops.get("all_reduce_gradients", OpCount()).completed == 1, w.ops
