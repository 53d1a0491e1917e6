"""The coordinator's field caps, Cluster budget, roles, stream and connection caps, and flags.

Pure checks run on the modules' own objects; the rest on a real in-process
:class:`Coordinator` (gRPC on loopback and its dashboard) with small
limits, so a cap is reached with a handful of calls.
"""

from __future__ import annotations

import http.client
import secrets
import socket
from collections.abc import Iterator

import grpc
import pytest
from helpers import wait_until

from collectives.v1 import coordinator_pb2 as pb
from collectives.v1 import coordinator_pb2_grpc as pb_grpc
from collectives.v1 import status_pb2
from collectives_server.cli.coordinator import config_from_args
from collectives_server.cli.local import coordinator_config_from_args
from collectives_server.cli.main import build_parser
from collectives_server.control_protocol import FIELD_LIMITS, WORKER_TOKEN_METADATA
from collectives_server.coordinator import Coordinator, CoordinatorConfig
from collectives_server.coordinator.admission import LeaseBook, WorkerAdmission
from collectives_server.coordinator.control import ControlLimits, peer_host
from collectives_server.coordinator.registration import (
    ClusterBudget,
    FieldTooLargeError,
    check_register,
    check_status,
)
from collectives_server.store_socket import listen_socket
from collectives_server.worker.enrolment import bounded_status

# ---------------------------------------------------------------- field caps


def _valid() -> pb.RegisterRequest:
    return pb.RegisterRequest(
        address="10.0.0.5:50052", hostname="node-1", devices=["cpu"], backend="gloo", version="1"
    )


@pytest.mark.parametrize("field", ["hostname", "address", "version", "backend", "retry_key"])
def test_each_string_field_is_capped_at_its_limit(field: str) -> None:
    limit = FIELD_LIMITS[field]
    request = _valid()
    setattr(request, field, "x" * limit)
    check_register(request)  # at the limit: accepted
    setattr(request, field, "x" * (limit + 1))
    with pytest.raises(
        FieldTooLargeError, match=rf"{field} is {limit + 1} bytes.*limit is {limit}"
    ):
        check_register(request)


def test_limits_count_utf8_bytes_not_characters() -> None:
    request = _valid()
    request.hostname = "é" * 128  # 256 bytes
    with pytest.raises(FieldTooLargeError, match="hostname is 256 bytes"):
        check_register(request)


def test_devices_are_capped_in_number_and_length() -> None:
    request = _valid()
    request.devices[:] = [f"cuda:{i}" for i in range(FIELD_LIMITS["devices"])]
    check_register(request)
    request.devices.append("cpu")
    with pytest.raises(FieldTooLargeError, match="devices has 65 entries; the limit is 64"):
        check_register(request)
    request.devices[:] = ["d" * 65]
    with pytest.raises(FieldTooLargeError, match="device is 65 bytes"):
        check_register(request)


def test_status_is_capped_at_64_kib() -> None:
    ok = status_pb2.WorkerStatus(last_op="s" * 60_000)
    assert check_status(ok) == ok.ByteSize()
    with pytest.raises(FieldTooLargeError, match=r"status is .* the limit is 65536 bytes"):
        check_status(status_pb2.WorkerStatus(last_op="s" * 66_000))


def test_cluster_budget_counts_what_was_admitted_since_the_last_measure() -> None:
    budget = ClusterBudget(1000)
    budget.measured(600)
    assert budget.fits(400) and not budget.fits(401)
    budget.admit(300)
    assert budget.estimate == 900 and not budget.fits(101)
    budget.set_status("w1", 50)
    budget.set_status("w1", 80)  # replaces: only the 30 bytes more count
    assert budget.estimate == 980
    budget.measured(700)  # a real Cluster message was built: exact again
    assert budget.estimate == 700
    budget.forget_except(["w2"])
    assert budget.status_delta("w1", 10) == 10


# ---------------------------------------------------------------- roles


class _Meta:
    def __init__(self, key: str, value: str) -> None:
        self.key, self.value = key, value


def test_worker_admission_needs_the_exact_worker_token() -> None:
    assert WorkerAdmission(None).problem(()) is None
    token = secrets.token_urlsafe(16)
    admission = WorkerAdmission(token)
    assert "workers only" in (admission.problem(()) or "")
    assert "workers only" in (admission.problem([_Meta("authorization", f"Bearer {token}")]) or "")
    assert "invalid worker token" in (
        admission.problem([_Meta(WORKER_TOKEN_METADATA, token + "x")]) or ""
    )
    assert admission.problem([_Meta(WORKER_TOKEN_METADATA, token)]) is None


def test_lease_book_secrets_and_retries() -> None:
    book = LeaseBook()
    key = secrets.token_hex(16)
    secret = book.issue("w-1", key)
    assert book.issue("w-1", key) == secret  # a retry of the same process: same secret
    assert book.is_retry("w-1", key)
    assert not book.is_retry("w-1", "") and not book.is_retry("w-1", "guess")
    assert book.problem("w-1", secret) is None
    assert "no lease_secret" in (book.problem("w-1", "") or "")
    assert "wrong lease_secret" in (book.problem("w-1", secret[:-1]) or "")
    assert book.problem("w-unknown", "") is None  # left to the membership: NOT_FOUND
    book.keep_only([])
    assert len(book) == 0


def test_peer_host_drops_the_port() -> None:
    assert peer_host("ipv4:10.0.0.5:41234") == "ipv4:10.0.0.5"
    assert peer_host("ipv6:[::1]:41234") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_store_socket_binds_only_the_host_asked_for() -> None:
    sock = listen_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


# ---------------------------------------------------------------- flags


def test_flag_defaults_are_the_documented_ones() -> None:
    coordinator = build_parser().parse_args(["coordinator", "--world-size", "2"])
    config = config_from_args(coordinator, coordinator.parser)
    assert config.worker_token is None
    assert config.limits == ControlLimits(
        max_waiting_workers=64, max_watch_streams=128, max_watch_streams_per_peer=32
    )
    assert (config.dashboard_idle_s, config.dashboard_max_connections) == (10.0, 256)
    local = build_parser().parse_args(["local", "--workers", "2"])
    assert local.worker_token_file is None
    local_config = coordinator_config_from_args(local)
    assert local_config.limits == config.limits
    assert (local_config.dashboard_idle_s, local_config.dashboard_max_connections) == (10.0, 256)
    worker = build_parser().parse_args(["worker", "--coordinator", "127.0.0.1:1"])
    assert worker.worker_token_file is None


def test_worker_token_file_is_read_and_checked(tmp_path) -> None:
    path = tmp_path / "wt"
    path.write_text("  the-worker-token\n")
    args = build_parser().parse_args(
        ["coordinator", "--world-size", "1", f"--worker-token-file={path}"]
    )
    assert config_from_args(args, args.parser).worker_token == "the-worker-token"
    path.write_text("")
    with pytest.raises(SystemExit):
        config_from_args(args, args.parser)


# ---------------------------------------------------------------- a real coordinator


@pytest.fixture
def small() -> Iterator[Coordinator]:
    config = CoordinatorConfig(
        min_workers=1,
        max_workers=64,
        join_window_s=30.0,  # nobody is sealed into a generation during the test
        lease_s=30.0,
        dashboard_port=0,
        metrics_port=0,
        dashboard_idle_s=1.0,
        dashboard_max_connections=4,
        limits=ControlLimits(
            max_watch_streams=3, max_watch_streams_per_peer=32, cluster_budget_bytes=12_000
        ),
    )
    with Coordinator(config) as coordinator:
        yield coordinator


def test_registrations_stop_at_the_cluster_budget(small: Coordinator) -> None:
    with grpc.insecure_channel(small.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        accepted, refusal = 0, None
        for i in range(64):
            request = pb.RegisterRequest(
                address=f"127.0.0.1:{1000 + i}",
                hostname="h" * 255,
                devices=["cpu"],
                pid=i,
                store_port=2000 + i,
            )
            try:
                stub.Register(request, timeout=10)
                accepted += 1
            except grpc.RpcError as exc:
                refusal = exc
                break
        assert refusal is not None and refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "12000 byte budget" in refusal.details()
        cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=10)
        assert len(cluster.workers) == accepted >= 10
        assert cluster.ByteSize() <= 12_000
    metrics = _scrape(small.metrics_address)
    assert 'collectives_coordinator_refused_total{reason="resource_exhausted"} 1.0' in metrics
    assert "collectives_cluster_message_bytes " in metrics


def _scrape(address: str | None) -> str:
    assert address is not None
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_a_status_over_the_budget_is_dropped_but_the_lease_renewed(small: Coordinator) -> None:
    with grpc.insecure_channel(small.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        registration = pb.RegisterRequest(address="127.0.0.1:9", devices=["cpu"], store_port=10)
        r = stub.Register(registration, timeout=10)
        big = status_pb2.WorkerStatus(last_op="s" * 20_000)  # under 64 KiB, over 12 kB
        reply = stub.Heartbeat(
            pb.HeartbeatRequest(worker_id=r.worker_id, lease_secret=r.lease_secret, status=big),
            timeout=10,
        )
        assert reply.version > 0
        worker = stub.GetCluster(pb.GetClusterRequest(), timeout=10).workers[0]
        assert worker.worker_id == r.worker_id and worker.status.last_op == ""
        assert worker.last_heartbeat_age_s < 5


def test_watch_streams_are_capped_in_total(small: Coordinator) -> None:
    with grpc.insecure_channel(small.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        streams = []
        try:
            for _ in range(3):
                stream = stub.WatchCluster(pb.WatchClusterRequest(), timeout=30)
                next(stream)
                streams.append(stream)
            extra = stub.WatchCluster(pb.WatchClusterRequest(), timeout=30)
            with pytest.raises(grpc.RpcError) as refused:
                next(extra)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-watch-streams 3" in refused.value.details()
            assert stub.GetCluster(pb.GetClusterRequest(), timeout=5).version > 0
        finally:
            for stream in streams:
                stream.cancel()


def test_dashboard_connections_are_capped_and_idle_ones_closed(small: Coordinator) -> None:
    host, port = small.dashboard_address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4)]
    try:
        wait_until(
            lambda: small._dashboard.open_connections >= 4,  # accepted by the server thread
            5,
            "the 4 idle dashboard connections accepted",
            interval_s=0.01,
        )
        # The fifth gets a 503 at once and is closed.
        with socket.create_connection((host, int(port)), timeout=5) as fifth:
            fifth.settimeout(5)
            assert fifth.recv(4096).startswith(b"HTTP/1.1 503")
        # After the 1 s idle timeout the idle ones are closed, and /healthz answers.
        for sock in idle:
            sock.settimeout(5)
            assert sock.recv(1) == b""
        conn = http.client.HTTPConnection(host, int(port), timeout=2)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        for sock in idle:
            sock.close()


def test_a_huge_hostname_is_refused_without_any_token_configured(small: Coordinator) -> None:
    """A huge registration field: a coordinator without tokens refuses it before storing it."""
    with grpc.insecure_channel(small.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        huge = pb.RegisterRequest(address="127.0.0.1:5", devices=["cpu"], hostname="h" * (3 << 20))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(huge, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hostname is 3145728 bytes; the limit is 255 bytes" in refused.value.details()
        cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=10)
        assert len(cluster.workers) == 0 and cluster.ByteSize() < 1024


def test_the_worker_drops_a_status_over_the_limit_rather_than_its_lease() -> None:
    small_status = status_pb2.WorkerStatus(last_op="all_reduce", models=["mlp"])
    assert bounded_status(small_status) is small_status
    assert bounded_status(None) is None
    names = [f"model-{i:05d}-" + "n" * 60 for i in range(1200)]  # ~84 kB of model names
    assert bounded_status(status_pb2.WorkerStatus(models=names)) is None


def test_a_worker_registers_with_the_store_it_hosts(small: Coordinator) -> None:
    """Every worker hosts the rendezvous store its generations may meet in; a
    registration without its port is refused, and nothing is registered."""
    with grpc.insecure_channel(small.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        storeless = pb.RegisterRequest(address="127.0.0.1:5", devices=["cpu"], pid=5)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(storeless, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "store_port 0 is not a port" in refused.value.details()
        assert len(stub.GetCluster(pb.GetClusterRequest(), timeout=10).workers) == 0
