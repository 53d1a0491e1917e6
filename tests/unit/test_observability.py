"""Observability without daemons: status publishing and history in the membership,
the JSON log format, the worker's counters, the SDK's typed status fields, and
the new command-line flags."""

from __future__ import annotations

import io
import json
import logging

import grpc
import pytest

from collectives.cli import main as client_cli
from collectives.observe import status_tables
from collectives.v1 import coordinator_pb2, status_pb2
from collectives.wire.cluster_state import ClusterSnapshot, DeviceMemory, OpCount, RecentError
from collectives_server.cli.coordinator import config_from_args as coordinator_config
from collectives_server.cli.main import build_parser
from collectives_server.cli.worker import config_from_args as worker_config
from collectives_server.coordinator.cluster_message import status_key
from collectives_server.coordinator.membership import HISTORY_LEN, Membership
from collectives_server.local import LocalCluster
from collectives_server.logfmt import JsonFormatter
from collectives_server.worker.status import LATENCY_BUCKETS_S, WorkerStats, status_label

# ----------------------------------------------------------------- membership


def _formed(refresh_s: float = 10.0, lease_s: float = 5.0) -> tuple[Membership, str, str]:
    m = Membership(
        2, 2, lease_s=lease_s, join_window_s=0.5, id_prefix="t", status_refresh_s=refresh_s
    )
    a, _ = m.register(0.0, address="h:1", pid=1, devices=["cpu"])
    b, _ = m.register(0.0, address="h:2", pid=2, devices=["cpu"])
    m.heartbeat(0.1, a, joined_generation=1)
    m.heartbeat(0.1, b, joined_generation=1)
    return m, a, b


def test_status_change_is_published_at_once_and_memory_only_changes_later() -> None:
    m, a, _ = _formed(refresh_s=10.0, lease_s=100.0)
    v0 = m.version
    first = m.heartbeat(1.0, a, joined_generation=1, status="s1", status_key=b"k1")
    assert first.changed and m.version == v0 + 1 and "status changed" in first.reason
    # Same key (only memory moved): stored, not published...
    quiet = m.heartbeat(2.0, a, joined_generation=1, status="s1-mem", status_key=b"k1")
    assert not quiet.changed and m.version == v0 + 1
    assert next(w for w in m.view(2.0).workers if w.worker_id == a).status == "s1-mem"
    # ... until the refresh interval passed since the last publication.
    late = m.heartbeat(11.0, a, joined_generation=1, status="s1-mem2", status_key=b"k1")
    assert late.changed and m.version == v0 + 2
    changed = m.heartbeat(11.5, a, joined_generation=1, status="s2", status_key=b"k2")
    assert changed.changed and m.version == v0 + 3
    # A heartbeat without a status keeps the last one.
    m.heartbeat(12.0, a, joined_generation=1)
    assert next(w for w in m.view(12.0).workers if w.worker_id == a).status == "s2"


def test_history_records_seals_and_events_count_membership_changes() -> None:
    m, _, b = _formed()
    assert m.events == {"joined": 2}
    record = m.view(0.2).history[-1]
    assert (record.generation, record.world_size, record.members) == (1, 2, ("h:1", "h:2"))
    assert "sealed generation 1" in record.reason and record.sealed_at == 0.0
    c, _ = m.register(0.3, address="h:3", pid=3, devices=["cpu"])
    m.heartbeat(3.0, b, joined_generation=1)
    m.heartbeat(3.0, c)
    m.tick(6.0)  # a's lease ran out: generation 2 with b, c
    assert m.generation == 2 and m.events["lost"] == 1
    last = m.view(6.0).history[-1]
    assert last.generation == 2 and last.members == ("h:2", "h:3")
    assert "lost" in last.reason and "sealed generation 2" in last.reason
    m.leave(6.5, c)
    assert m.events == {"joined": 3, "lost": 1, "left": 1}


def test_history_is_bounded() -> None:
    m = Membership(1, 2, lease_s=5.0, join_window_s=0.0, id_prefix="t")
    now = 0.0
    first, _ = m.register(now, address="h:1", pid=1, devices=["cpu"])
    m.tick(now)
    for i in range(HISTORY_LEN + 5):
        now += 1.0
        other, _ = m.register(now, address=f"h:{100 + i}", pid=100 + i, devices=["cpu"])
        m.heartbeat(now, first)
        m.tick(now)
        m.leave(now, other)
    history = m.view(now).history
    assert len(history) == HISTORY_LEN
    assert history[-1].generation == m.generation
    assert [r.generation for r in history] == sorted(r.generation for r in history)


def test_status_key_ignores_memory_in_use_only() -> None:
    base = status_pb2.WorkerStatus(tensors_held=1, process_rss_bytes=10)
    base.devices.add(device="cpu", memory_used_bytes=5, memory_total_bytes=100)
    moved = status_pb2.WorkerStatus()
    moved.CopyFrom(base)
    moved.process_rss_bytes = 20
    moved.host_memory_available_bytes = 7
    moved.devices[0].memory_used_bytes = 6
    assert status_key(base) == status_key(moved)
    moved.tensors_held = 2
    assert status_key(base) != status_key(moved)


# ------------------------------------------------------------------------ logs


def test_json_formatter_puts_extras_at_the_top_level() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("worker"))
    logger = logging.getLogger("test.observability.json")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    try:
        logger.debug("op %d done", 7, extra={"op_id": 7, "ranks": [0, 1], "latency_s": 0.5})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "op 7 done" and first["level"] == "DEBUG"
    assert first["op_id"] == 7 and first["ranks"] == [0, 1] and first["latency_s"] == 0.5
    assert first["logger"] == "test.observability.json" and first["role"] == "worker"
    assert first["time"].endswith("Z") and isinstance(first["pid"], int)
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


# ---------------------------------------------------------------- worker stats


def test_worker_stats_count_ops_by_outcome_and_keep_recent_errors() -> None:
    stats = WorkerStats()
    stats.record("all_reduce", None, 0.002, op_id=1, generation=1)
    stats.record("all_reduce", grpc.StatusCode.NOT_FOUND, 0.001, op_id=2, generation=1, message="x")
    for i in range(25):
        stats.record("get", grpc.StatusCode.NOT_FOUND, 100.0, message=f"miss {i}")
    assert stats.ops_completed == {"all_reduce": 1}
    assert stats.ops_failed == {"all_reduce": 1, "get": 25}
    assert stats.ops_by_status[("all_reduce", "not_found")] == 1
    assert stats.ops_by_status[("all_reduce", "ok")] == 1
    assert len(stats.recent_errors) == 20 and stats.recent_errors[-1].message == "miss 24"
    assert (stats.last_op, stats.last_op_latency_s) == ("get", 100.0)
    counts, total = stats.latency_snapshot()["get"]
    assert counts[-1] == 25 and total == 2500.0  # above the largest bound: +Inf
    counts, _ = stats.latency_snapshot()["all_reduce"]
    assert sum(counts) == 2 and len(counts) == len(LATENCY_BUCKETS_S) + 1
    assert status_label(None) == "ok" and status_label(grpc.StatusCode.OK) == "ok"
    assert status_label(grpc.StatusCode.DEADLINE_EXCEEDED) == "deadline_exceeded"


# ------------------------------------------------------------------------- SDK


def _cluster_with_status() -> coordinator_pb2.Cluster:
    status = status_pb2.WorkerStatus(
        tensors_held=2, bytes_held=96, models=["mlp"], last_op="all_reduce",
        last_op_latency_s=0.25, queue_depth=1, package_version="0.1.0", torch_version="2",
        backend_version="2", bytes_received=64, bytes_sent=32, process_rss_bytes=1000,
        host_memory_total_bytes=4000, host_memory_available_bytes=3000, data_collectives=5,
        gradient_buckets_reduced=2, graphs_retained=1,
    )  # fmt: skip
    status.ops.add(
        kind="all_reduce", completed=3, failed=1, rate_per_s=2.5, latency_p50_us=1000,
        latency_p99_us=4000, collective_bytes_received=4096, collective_bytes_sent=4096,
    )  # fmt: skip
    status.ops.add(kind="put", completed=2)
    status.error_groups.add(
        kind="all_reduce", code="NOT_FOUND", message="m", count=7, first_unix_time_s=1.0,
        last_unix_time_s=1.5, rate_per_s=0.5, client="trainer (ipv4:127.0.0.1:5)", last_op_id=4,
    )  # fmt: skip
    status.clients.add(
        peer="ipv4:127.0.0.1:5", user_agent="collectives-client/trainer grpc-python/1",
        name="trainer", last_unix_time_s=1.5,
    )  # fmt: skip
    status.devices.add(device="cpu", memory_used_bytes=1000, memory_total_bytes=4000)
    status.recent_errors.add(
        unix_time_s=1.5, op_id=4, generation=1, kind="all_reduce", code="NOT_FOUND", message="m"
    )
    msg = coordinator_pb2.Cluster(generation=1, formed=True, world_size=1, version=3)
    msg.workers.add(
        worker_id="a", rank=0, address="h:1", state=coordinator_pb2.WORKER_STATE_READY,
        devices=["cpu"], status=status,
    )  # fmt: skip
    msg.workers.add(worker_id="b", rank=-1, address="h:2", devices=["cpu"])
    msg.history.add(
        generation=1, sealed_unix_time_s=2.0, world_size=1, members=["h:1"], reason="sealed"
    )
    return msg


def test_worker_info_exposes_the_status_as_typed_fields() -> None:
    snap = ClusterSnapshot.from_proto(_cluster_with_status())
    w, bare = snap.workers
    assert w.has_status and not bare.has_status and bare.ops == {} and bare.models == ()
    assert (w.tensors_held, w.bytes_held, w.models) == (2, 96, ("mlp",))
    assert w.ops == {"all_reduce": OpCount(3, 1, 2.5, 0.001, 0.004, 4096, 4096), "put": OpCount(2)}
    assert w.error_groups[0].count == 7 and w.error_groups[0].client.startswith("trainer")
    assert w.clients[0].name == "trainer" and w.clients[0].label.startswith("trainer (")
    assert (w.ops_completed, w.ops_failed) == (5, 1)
    assert (w.last_op, w.last_op_latency_s, w.queue_depth) == ("all_reduce", 0.25, 1)
    assert w.device_memory == (DeviceMemory("cpu", 1000, 4000),)
    assert (w.bytes_received, w.bytes_sent, w.process_rss_bytes) == (64, 32, 1000)
    assert (w.host_memory_total_bytes, w.host_memory_available_bytes) == (4000, 3000)
    assert w.recent_errors == (RecentError(1.5, 4, 1, "all_reduce", "NOT_FOUND", "m"),)
    assert (w.data_collectives, w.gradient_buckets_reduced, w.graphs_retained) == (5, 2, 1)
    assert snap.history[0].members == ("h:1",) and snap.history[0].reason == "sealed"
    data = json.loads(json.dumps(snap.to_dict()))
    assert data["workers"][0]["ops"]["put"] == {
        "completed": 2, "failed": 0, "rate_per_s": 0.0, "latency_p50_s": 0.0,
        "latency_p99_s": 0.0, "collective_bytes_received": 0, "collective_bytes_sent": 0,
    }  # fmt: skip
    assert data["ops_by_kind"]["all_reduce"]["rate_per_s"] == 2.5
    assert data["error_groups"][0]["count"] == 7 and data["error_groups"][0]["ranks"] == [0]
    assert data["clients"][0]["name"] == "trainer" and data["clients"][0]["workers"] == ["h:1"]
    assert data["workers"][0]["device_memory"][0]["used_bytes"] == 1000
    assert data["history"][0]["generation"] == 1
    table = client_cli.format_table("c:1", snap, width=1000)
    assert "7x all_reduce NOT_FOUND: m" in table and "last op 4" in table and "sealed" in table


def test_top_shows_the_reported_rates_from_the_first_frame() -> None:
    """A worker's OPS/S is what it reports (no second frame needed); the rate between
    two snapshots stands in only for a worker without a status."""
    before = ClusterSnapshot.from_proto(_cluster_with_status())
    msg = _cluster_with_status()
    msg.workers[0].status.ops[1].completed = 12  # 10 more puts
    msg.workers[1].status.tensors_held = 0  # h:2 has no status: the fallback
    msg.workers[1].ClearField("status")
    after = ClusterSnapshot.from_proto(msg)
    rates = status_tables.rates_between(before, after, 2.0)
    assert rates == {"h:1": 5.0, "h:2": 0.0}
    first = client_cli.format_top("c:1", before, None, width=1000)
    row = next(line for line in first.splitlines() if line.startswith("0 "))
    assert "2.5" in row.split()  # the reported rate, in the first frame
    assert "7x all_reduce NOT_FOUND: m" in first and "last op 4, client trainer" in first
    assert "trainer at ipv4:127.0.0.1" in first
    kinds = [line.split() for line in first.splitlines() if line.startswith(("all_reduce", "  "))]
    assert ["all_reduce", "all", "2.5", "3", "1", "1.00ms", "4.00ms", "4.0KiB", "4.0KiB"] in kinds
    narrow = client_cli.format_top("c:1", after, rates, width=80).splitlines()
    assert max(map(len, narrow)) <= 80 and "2.5" in "\n".join(narrow)
    assert status_tables.human_bytes(1536) == "1.5KiB" and status_tables.human_bytes(10) == "10B"


# ------------------------------------------------------------------------- CLI


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_metrics_and_log_format_flags() -> None:
    args = _parse("coordinator", "--world-size", "2")
    config = coordinator_config(args, args.parser)
    assert config.metrics_port is None and config.metrics_host == "127.0.0.1"
    assert args.log_format == "text"
    args = _parse("coordinator", "--world-size", "2", "--metrics-port", "9100", "--log-format",
                  "json", "--metrics-host", "0.0.0.0")  # fmt: skip
    config = coordinator_config(args, args.parser)
    assert (config.metrics_port, config.metrics_host, args.log_format) == (9100, "0.0.0.0", "json")
    worker = worker_config(_parse("worker", "--coordinator", "h:1", "--metrics-port", "0"))
    assert (worker.metrics_port, worker.metrics_host) == (0, "127.0.0.1")
    assert worker_config(_parse("worker", "--coordinator", "h:1")).metrics_port is None
    local = _parse("local", "--workers", "2", "--metrics-port", "9200", "--log-format", "json")
    assert (local.metrics_port, local.log_format) == (9200, "json")
    with pytest.raises(SystemExit):
        _parse("worker", "--coordinator", "h:1", "--log-format", "xml")


def test_local_gives_each_child_its_own_metrics_port() -> None:
    cluster = LocalCluster(2, metrics_port=9300, metrics_host="127.0.0.1", devices="cpu")
    coordinator = cluster.coordinator_config()
    assert (coordinator.metrics_port, coordinator.metrics_host) == (9300, "127.0.0.1")
    assert [cluster.worker_config(slot).metrics_port for slot in (0, 1)] == [9301, 9302]
    assert cluster.worker_config(1).metrics_host == "127.0.0.1"
    assert LocalCluster(2, metrics_port=0, devices="cpu").worker_config(1).metrics_port == 0
    assert LocalCluster(2, devices="cpu").worker_config(1).metrics_port is None


def test_local_metrics_port_range_is_checked(capsys) -> None:
    args = _parse("local", "--workers", "3", "--metrics-port", "65534")
    with pytest.raises(SystemExit):
        args.run(args)
    assert "leaves no room for 3 workers" in capsys.readouterr().err


def test_a_cluster_still_forming_says_what_it_waits_for_and_how_to_wait() -> None:
    empty = ClusterSnapshot.from_proto(
        coordinator_pb2.Cluster(version=1, min_workers=2, max_workers=2, status="waiting")
    )
    table = status_tables.format_table("c:1", empty, width=1000)
    assert "forming: 0 of 2 workers registered" in table and "--watch" in table
    formed = ClusterSnapshot.from_proto(_cluster_with_status())
    assert "forming" not in status_tables.format_table("c:1", formed, width=1000)
