"""The dashboard's HTTP server without a browser: routes, headers, JSON, event stream.

A fake cluster source stands in for the coordinator servicer (its version bumps
on demand), and one test runs a real in-process :class:`Coordinator` with the
dashboard on to check the wiring and the ``--dashboard-*`` flags.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Iterator

import pytest

from collectives.cli.main import _json_line as cli_json_line
from collectives.v1 import coordinator_pb2, status_pb2
from collectives.wire.cluster_state import ClusterSnapshot
from collectives_server.cli.coordinator import config_from_args
from collectives_server.cli.main import build_parser
from collectives_server.coordinator import Coordinator, CoordinatorConfig
from collectives_server.coordinator.dashboard.server import DashboardServer


class FakeSource:
    """A cluster whose version moves when :meth:`bump` is called (like the servicer)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._cluster = coordinator_pb2.Cluster(generation=1, version=10, world_size=2)
        self._cluster.workers.add(
            worker_id="w1", rank=0, state=coordinator_pb2.WORKER_STATE_READY, devices=["cpu"]
        )
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def snapshot(self) -> coordinator_pb2.Cluster:
        with self._cond:
            return coordinator_pb2.Cluster.FromString(self._cluster.SerializeToString())

    def wait_for_change(self, after_version: int, timeout_s: float):
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or self._cluster.version > after_version, timeout_s
            )
            if self._closed or self._cluster.version <= after_version:
                return None
            return coordinator_pb2.Cluster.FromString(self._cluster.SerializeToString())

    def bump(self, generation: int) -> None:
        with self._cond:
            self._cluster.generation = generation
            self._cluster.version += 1
            self._cond.notify_all()

    def replace(self, cluster: coordinator_pb2.Cluster) -> None:
        with self._cond:
            self._cluster = coordinator_pb2.Cluster.FromString(cluster.SerializeToString())
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@pytest.fixture
def source() -> Iterator[FakeSource]:
    fake = FakeSource()
    yield fake
    fake.close()


@pytest.fixture
def dashboard(source: FakeSource) -> Iterator[DashboardServer]:
    server = DashboardServer(source, port=0, refresh_s=30.0).start()
    yield server
    server.stop()


def get(server: DashboardServer, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def read_events(response: http.client.HTTPResponse, count: int) -> list[dict]:
    """The data of the next ``count`` ``cluster`` events of a stream."""
    events: list[dict] = []
    kind = None
    while len(events) < count:
        line = response.fp.readline().decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: ") and kind == "cluster":
            events.append(json.loads(line[len("data: ") :]))
    return events


@pytest.mark.parametrize(
    ("path", "content_type", "needle"),
    [
        ("/", "text/html", b'id="generation"'),
        ("/index.html", "text/html", b'src="app.js"'),
        ("/app.js", "text/javascript", b"EventSource"),
        ("/model.js", "text/javascript", b"groupFailures"),
        ("/style.css", "text/css", b".state-lost"),
    ],
)
def test_page_and_assets(dashboard, path: str, content_type: str, needle: bytes) -> None:
    status, headers, body = get(dashboard, path)
    assert status == 200
    assert headers["Content-Type"].startswith(content_type)
    assert needle in body
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    # Nothing may come from the network: no absolute URLs in the shipped assets
    # (the SVG namespace name is an identifier, never fetched).
    body = body.replace(b'"http://www.w3.org/2000/svg"', b"")
    assert b"http://" not in body and b"https://" not in body


def test_api_cluster_is_the_status_json_schema(dashboard) -> None:
    status, headers, body = get(dashboard, "/api/cluster?x=1")
    assert status == 200 and headers["Content-Type"] == "application/json"
    data = json.loads(body)
    assert data["generation"] == 1  # a JSON number, as in status --json
    assert data["world_size"] == 2
    assert data["formed"] is False  # defaults are present
    assert data["history"] == []
    (worker,) = data["workers"]
    assert (worker["worker_id"], worker["state"]) == ("w1", "ready")


def _rich_cluster() -> coordinator_pb2.Cluster:
    """A Cluster with every kind of field set, from fresh random values."""
    rng = random.Random()
    cluster = coordinator_pb2.Cluster(
        generation=rng.randrange(1, 1 << 40), formed=True, ready=True, world_size=2,
        version=rng.randrange(1, 1 << 50), status="formed", op_timeout_s=rng.uniform(1, 60),
        min_workers=1, max_workers=4, store_address="127.0.0.1:29500",
    )  # fmt: skip
    states = [coordinator_pb2.WORKER_STATE_READY, coordinator_pb2.WORKER_STATE_LOST]
    for rank, state in zip((0, -1), states, strict=True):
        status = status_pb2.WorkerStatus(
            tensors_held=rng.randrange(1 << 20), bytes_held=rng.randrange(1 << 45),
            models=["m"], last_op="all_reduce", last_op_latency_s=rng.random(),
            queue_depth=rng.randrange(9), process_rss_bytes=rng.randrange(1 << 40),
        )  # fmt: skip
        status.ops.add(kind="all_reduce", completed=rng.randrange(1 << 40), failed=3)
        status.devices.add(device="cpu", memory_used_bytes=rng.randrange(1 << 33))
        status.recent_errors.add(
            unix_time_s=1.7e9 + rng.random(), op_id=rng.randrange(1 << 40), generation=4,
            kind="all_reduce", code="DEADLINE_EXCEEDED", message="timed out",
        )  # fmt: skip
        cluster.workers.add(
            worker_id=f"w{rank}", rank=rank, address=f"127.0.0.1:{rng.randrange(1024, 65535)}",
            state=state, devices=["cpu"], hostname="h", pid=rng.randrange(1, 1 << 22),
            joined_generation=cluster.generation, last_heartbeat_age_s=rng.random(),
            backend="gloo", uptime_s=rng.uniform(0, 1e5), version="0.1", status=status,
        )  # fmt: skip
    cluster.history.add(
        generation=cluster.generation, sealed_unix_time_s=1.7e9, world_size=2,
        members=["127.0.0.1:1", "127.0.0.1:2"], reason="worker lost",
    )  # fmt: skip
    return cluster


def test_api_cluster_equals_status_json(dashboard, source) -> None:
    """/api/cluster and ``collectives status --json`` print the same thing for one message."""
    cluster = _rich_cluster()
    source.replace(cluster)
    _, _, body = get(dashboard, "/api/cluster")
    served = json.loads(body)
    printed = json.loads(cli_json_line("127.0.0.1:50051", ClusterSnapshot.from_proto(cluster)))
    assert printed.pop("coordinator") == "127.0.0.1:50051"
    assert served == printed
    assert [w["state"] for w in served["workers"]] == ["ready", "lost"]
    assert served["version"] == cluster.version and isinstance(served["version"], int)
    assert served["workers"][0]["ops_failed"] == 3


def test_healthz_and_unknown_paths(dashboard) -> None:
    assert get(dashboard, "/healthz")[::2] == (200, b"ok\n")
    assert get(dashboard, "/static/../../etc/passwd")[0] == 404
    assert get(dashboard, "/api/nope")[0] == 404


def test_event_stream_pushes_every_version_change(dashboard, source) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", dashboard.port, timeout=10)
    try:
        conn.request("GET", "/api/events")
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type").startswith("text/event-stream")
        (first,) = read_events(response, 1)
        assert first["generation"] == 1
        # refresh_s is 30 s: an event within the socket timeout comes from the change.
        start = time.monotonic()
        source.bump(2)
        (second,) = read_events(response, 1)
        assert second["generation"] == 2
        assert second["version"] == first["version"] + 1
        assert time.monotonic() - start < 5
    finally:
        conn.close()


def test_event_stream_refreshes_without_changes(source) -> None:
    server = DashboardServer(source, port=0, refresh_s=0.1).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/api/events")
        events = read_events(conn.getresponse(), 3)
        assert [e["version"] for e in events] == [10, 10, 10]
        conn.close()
    finally:
        server.stop()


def test_event_streams_are_capped(source) -> None:
    server = DashboardServer(source, port=0, refresh_s=30.0, max_streams=1).start()
    try:
        first = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        first.request("GET", "/api/events")
        read_events(first.getresponse(), 1)
        status, _, body = get(server, "/api/events")
        assert status == 503 and b"poll /api/cluster" in body
        first.close()
    finally:
        server.stop()


def test_event_stream_ends_when_the_source_closes(dashboard, source) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", dashboard.port, timeout=10)
    try:
        conn.request("GET", "/api/events")
        response = conn.getresponse()
        read_events(response, 1)
        source.close()
        assert response.read().strip() == b""  # the server ended it (no socket timeout)
    finally:
        conn.close()


def test_coordinator_serves_its_dashboard() -> None:
    args = build_parser().parse_args(
        ["coordinator", "--world-size", "2", "--dashboard-port", "0", "--dashboard-host", "::1"]
    )
    config = config_from_args(args, args.parser)
    assert (config.dashboard_port, config.dashboard_host) == (0, "::1")
    args = build_parser().parse_args(["coordinator", "--world-size", "2"])
    assert config_from_args(args, args.parser).dashboard_port is None  # off by default

    config = CoordinatorConfig(min_workers=2, max_workers=2, dashboard_port=0)
    with Coordinator(config) as coordinator:
        address = coordinator.dashboard_address
        assert address is not None and address.startswith("127.0.0.1:")
        conn = http.client.HTTPConnection(address, timeout=10)
        conn.request("GET", "/api/cluster")
        data = json.loads(conn.getresponse().read())
        conn.close()
        expected = coordinator.cluster()
        assert data["status"] == expected.status
        assert (data["min_workers"], data["max_workers"]) == (2, 2)
        assert data["formed"] is False
    assert coordinator.dashboard_address is None
    with Coordinator(CoordinatorConfig(min_workers=1, max_workers=1)) as coordinator:
        assert coordinator.dashboard_address is None


def test_without_details_keeps_kinds_and_outcomes_and_withholds_names_clients_messages():
    from collectives.v1 import flight_record_pb2
    from collectives_server.coordinator.dashboard.json_api import WITHHELD, without_details

    cluster = coordinator_pb2.Cluster(generation=3, formed=True, world_size=1)
    worker = cluster.workers.add(rank=0, address="127.0.0.1:5000")
    status = worker.status
    status.clients.add(peer="ipv4:10.1.2.3:4000", name="billing", user_agent="grpc-python")
    status.recent_ops.append(
        flight_record_pb2.FlightRecordOp(
            op_id=9, kind="all_reduce", names=["secret/w"], client="billing (ipv4:10.1.2.3)",
            call_id="c-77", code=5, message="tensor 'secret/w' not found",
        )
    )  # fmt: skip
    status.recent_errors.add(op_id=9, kind="all_reduce", code="NOT_FOUND", message="'secret/w'")
    status.error_groups.add(kind="all_reduce", code="NOT_FOUND", message="'secret/w'",
                            count=4, client="billing (ipv4:10.1.2.3)")  # fmt: skip
    status.stuck = "op 9 all_reduce 'secret/w' (generation 3): data phase for 9.0 s on rank 0"

    shown = without_details(cluster)
    text = str(shown)
    assert "secret" not in text and "billing" not in text and "10.1.2.3" not in text
    assert "c-77" not in text
    op = shown.workers[0].status.recent_ops[0]
    assert (op.op_id, op.kind, op.code, op.message) == (9, "all_reduce", 5, WITHHELD)
    group = shown.workers[0].status.error_groups[0]
    assert (group.kind, group.code, group.count) == ("all_reduce", "NOT_FOUND", 4)
    assert shown.workers[0].status.stuck.endswith(WITHHELD)
    assert shown.workers[0].address == "127.0.0.1:5000"
    assert "secret" in str(cluster)  # the original is left as it was
