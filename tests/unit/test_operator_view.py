"""The operator's view, piece by piece: rate and latency windows, error groups,
the client table, the collective traffic model, WorkerStats' recorders, the
cluster's aggregation by kind, and the client name in the gRPC user agent."""

from __future__ import annotations

import grpc
import pytest

from collectives.transport import channels
from collectives.v1 import coordinator_pb2, status_pb2
from collectives.wire.cluster_state import ClusterSnapshot
from collectives.wire.op_specs import OpKind
from collectives_server.coordinator.cluster_message import status_key
from collectives_server.worker.stats import WorkerStats
from collectives_server.worker.telemetry.clients import ClientTable, client_name, short_user_agent
from collectives_server.worker.telemetry.collective_traffic import collective_traffic
from collectives_server.worker.telemetry.error_groups import ErrorGroups, grouped_message
from collectives_server.worker.telemetry.windows import LatencyWindow, WindowedRate


def test_the_windowed_rate_reads_a_burst_at_once_and_decays_when_idle() -> None:
    rate = WindowedRate(10.0)
    assert rate.rate(5.0) == 0.0
    for i in range(100):  # 10 per second from t=1000 to t=1010
        rate.add(1000.0 + i * 0.1)
    assert rate.rate(1010.0) == pytest.approx(10.0)
    assert 0 < rate.rate(1015.0) < 10.0
    assert rate.rate(1030.0) == 0.0
    burst = WindowedRate(10.0)
    burst.add(50.0, 20)
    assert burst.rate(50.5) == 20.0  # over at least one second


def test_the_latency_window_keeps_the_last_values() -> None:
    window = LatencyWindow(4)
    assert window.percentiles(50, 99) == (0.0, 0.0)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        window.add(v)
    assert len(window) == 4 and window.percentiles(50, 99, 100) == (4.0, 6.0, 6.0)


def test_error_groups_count_by_kind_code_and_message_and_stay_bounded() -> None:
    groups = ErrorGroups(limit=3)
    for op_id in range(1, 149):
        message = (
            f"op {op_id} (all_reduce, generation 1): tensor 'load/only0' is missing on rank(s) 1"
        )
        groups.record("all_reduce", "NOT_FOUND", message, op_id)
    groups.attribute("NOT_FOUND", "op 999 (x): tensor 'load/only0' is missing on rank(s) 1", "me")
    [g] = groups.to_proto()
    assert (g.count, g.last_op_id, g.client) == (148, 148, "me")
    assert g.message == "tensor 'load/only0' is missing on rank(s) 1"
    assert g.first_unix_time_s <= g.last_unix_time_s and g.rate_per_s > 0
    for i in range(5):
        groups.record("get", "NOT_FOUND", f"tensor 't{i}' is not stored")
    assert len(groups) == 3
    assert groups.to_proto()[0].message == "tensor 't4' is not stored"
    assert (
        grouped_message("op 7 (reduce) failed in generation 2: x")
        == "op # (reduce) failed in generation 2: x"
    )


def test_the_client_table_reads_the_user_agent_once_per_peer() -> None:
    reads = []

    def metadata():
        reads.append(1)
        return (("user-agent", "collectives-client/trainer-3 grpc-python/1.7"), ("x", "y"))

    table = ClientTable(limit=2)
    assert table.seen("ipv4:10.0.0.1:5", metadata) == "trainer-3 (ipv4:10.0.0.1:5)"
    table.seen("ipv4:10.0.0.1:5", metadata)
    assert len(reads) == 1
    table.seen("ipv4:10.0.0.2:6", lambda: ())
    table.seen("ipv4:10.0.0.3:7", lambda: ())
    clients = table.to_proto()
    assert [c.peer for c in clients] == ["ipv4:10.0.0.3:7", "ipv4:10.0.0.2:6"]
    assert client_name("grpc-python/1.7") == "" and client_name("collectives-client/a.b") == "a.b"
    assert clients[0].user_agent == "" and table.to_proto()[1].user_agent == ""
    agent = "collectives-client/t-3 grpc-python/1.85.1 grpc-c/58.0.0 (linux; chttp2)"
    assert short_user_agent(agent) == "grpc-python/1.85.1"
    assert short_user_agent("grpc-go/1.2 " + "x" * 100) == ("grpc-go/1.2 " + "x" * 100)[:64]


@pytest.mark.parametrize(
    ("kind", "size", "root", "expected"),
    [
        (OpKind.ALL_REDUCE, 2, False, (4096, 4096)),
        (OpKind.ALL_REDUCE, 4, False, (6144, 6144)),
        (OpKind.REDUCE_SCATTER, 4, False, (3072, 3072)),
        (OpKind.ALL_TO_ALL, 2, False, (2048, 2048)),
        (OpKind.ALL_GATHER, 3, False, (8192, 8192)),
        (OpKind.BROADCAST, 3, True, (0, 8192)),
        (OpKind.BROADCAST, 3, False, (4096, 0)),
        (OpKind.REDUCE, 3, True, (8192, 0)),
        (OpKind.GATHER, 3, False, (0, 4096)),
        (OpKind.BARRIER, 3, False, (0, 0)),
        (OpKind.ALL_REDUCE, 1, False, (0, 0)),
    ],
)
def test_the_collective_traffic_model(kind, size, root, expected) -> None:
    assert collective_traffic(kind, 4096, size, root) == expected


def test_worker_stats_recorders() -> None:
    stats = WorkerStats()
    stats.record_fused(3)
    stats.record_fused(2)
    stats.record_data_collectives(4, 1)
    stats.add_collective_bytes("all_reduce", received=10, sent=20)
    stats.add_collective_bytes("all_reduce", received=1, sent=2)
    for latency in (0.001, 0.002, 0.003):
        stats.record("all_reduce", None, latency)
    stats.record("all_reduce", grpc.StatusCode.NOT_FOUND, 0.004, op_id=9, message="gone")
    assert (stats.fused_runs, stats.fused_ops) == (2, 5)
    assert (stats.data_collectives, stats.gradient_buckets_reduced) == (4, 1)
    assert stats.collective_bytes["all_reduce"] == [11, 22]
    with stats.lock:
        summary = stats.kind_summaries()["all_reduce"]
    assert summary.rate_per_s == 4.0 and (summary.p50_s, summary.p99_s) == (0.002, 0.004)
    [group] = stats.error_groups.to_proto()
    assert (group.count, group.last_op_id, group.message) == (1, 9, "gone")


def _cluster() -> ClusterSnapshot:
    msg = coordinator_pb2.Cluster(generation=1, formed=True, world_size=2, version=1)
    for rank, (rate, p99, puts) in enumerate(((5.0, 0.004, 3), (4.0, 0.009, 2))):
        status = status_pb2.WorkerStatus()
        status.ops.add(
            kind="all_reduce", completed=10, failed=1, rate_per_s=rate,
            latency_p99_us=round(p99 * 1e6), collective_bytes_received=100,
            collective_bytes_sent=100,
        )  # fmt: skip
        status.ops.add(kind="put", completed=puts, rate_per_s=puts)
        status.error_groups.add(
            kind="all_reduce", code="NOT_FOUND", message="m", count=1, first_unix_time_s=rank,
            last_unix_time_s=10 + rank, client="c (p)" if rank == 0 else "",
        )  # fmt: skip
        status.clients.add(peer=f"ipv4:1.2.3.4:{rank}", name="c")
        msg.workers.add(
            worker_id=str(rank), rank=rank, address=f"h:{rank}", status=status,
            state=coordinator_pb2.WORKER_STATE_READY,
        )  # fmt: skip
    return ClusterSnapshot.from_proto(msg)


def test_the_cluster_counts_a_collective_once_and_sums_calls_to_workers() -> None:
    snap = _cluster()
    kinds = snap.ops_by_kind()
    ar, put = kinds["all_reduce"], kinds["put"]
    assert (ar.completed, ar.failed, ar.rate_per_s, ar.latency_p99_s) == (10, 1, 5.0, 0.009)
    assert ar.collective_bytes_received == 200
    assert (put.completed, put.rate_per_s) == (5, 5.0)
    [merged] = snap.error_groups()
    g = merged.group
    assert (g.count, g.first_unix_time_s, g.last_unix_time_s, g.client) == (1, 0.0, 11.0, "c (p)")
    assert merged.ranks == (0, 1) and merged.reporters == ("h:0", "h:1")
    [client] = snap.clients()
    assert client.name == "c" and client.workers == ("h:0", "h:1")


def test_the_client_name_goes_into_the_user_agent(monkeypatch) -> None:
    monkeypatch.delenv(channels.CLIENT_NAME_ENV, raising=False)
    assert channels.channel_options() == channels.CHANNEL_OPTIONS
    monkeypatch.setenv(channels.CLIENT_NAME_ENV, " trainer 3/evil ")
    agent = dict(channels.channel_options())["grpc.primary_user_agent"]
    assert agent == "collectives-client/trainer_3_evil"
    assert client_name(agent + " grpc-python/1.7") == "trainer_3_evil"


def test_drifting_rates_and_call_times_do_not_push_a_new_cluster() -> None:
    """A worker idle after a burst reports decaying rates: the status key ignores
    them (and the clients' last-call times), so watchers are not woken for them."""

    def status(rate: float, last: float, completed: int = 3) -> status_pb2.WorkerStatus:
        s = status_pb2.WorkerStatus()
        s.ops.add(kind="all_reduce", completed=completed, rate_per_s=rate)
        s.error_groups.add(kind="all_reduce", code="NOT_FOUND", message="m", rate_per_s=rate)
        s.clients.add(peer="ipv4:1.2.3.4:5", last_unix_time_s=last)
        return s

    assert status_key(status(9.0, 1.0)) == status_key(status(0.5, 2.0))
    assert status_key(status(9.0, 1.0)) != status_key(status(9.0, 1.0, completed=4))
