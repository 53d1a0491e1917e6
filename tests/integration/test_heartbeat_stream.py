"""HeartbeatStream over real gRPC: a coordinator child process, raw stubs, a real worker.

The stream renews leases like unary Heartbeat calls, answers only the requests that
ask (``want_reply``), ends with NOT_FOUND for an unknown worker, is cancelled by
the coordinator once its worker is declared lost, is refused beyond the stream
limit, and ends when the coordinator stops. The worker daemon heartbeats on it,
registers again through it after a coordinator restart, and falls back to unary
calls when streams are refused. Waits are on conditions with deadlines; the only
pauses are heartbeat intervals, which are the workload itself.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from helpers import wait_until
from launcher import Daemon, free_port, launch
from prometheus_client.parser import text_string_to_metric_families

from collectives.v1 import coordinator_pb2 as pb
from collectives.v1 import coordinator_pb2_grpc as pb_grpc
from collectives_server.coordinator import Coordinator, CoordinatorConfig
from collectives_server.coordinator import daemon as coordinator_daemon
from collectives_server.worker.heartbeats import HeartbeatStream

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_S = 0.2
# Long enough that a loaded machine, starving a beating thread for a second or two,
# does not lose a worker these tests keep alive; short enough to wait for one lost.
LEASE_S = 3.0
FAST = ["--heartbeat", str(HEARTBEAT_S), "--lease", str(LEASE_S), "--join-window", "0.1"]


def start_coordinator(tmp_path: Path, *args: str) -> Daemon:
    argv = [sys.executable, "-m", "collectives_server", "coordinator", *args, *FAST]
    return launch(argv, tmp_path / "coordinator.log")


def start_worker(tmp_path: Path, coordinator: str) -> Daemon:
    argv = [
        sys.executable,
        "-m",
        "collectives_server",
        "worker",
        "--coordinator",
        coordinator,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--devices",
        "cpu",
    ]
    return launch(argv, tmp_path / "worker.log")


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Daemon]:
    daemon = start_coordinator(tmp_path, "--port", "0", "--world-size", "1")
    try:
        yield daemon
    finally:
        daemon.kill()


@pytest.fixture
def stub(coordinator: Daemon) -> Iterator[pb_grpc.CoordinatorStub]:
    with grpc.insecure_channel(coordinator.address) as channel:
        yield pb_grpc.CoordinatorStub(channel)


# worker id -> the lease secret Register returned (heartbeats must carry it).
LEASE_SECRETS: dict[str, str] = {}


def register(stub: pb_grpc.CoordinatorStub, port: int = 7001) -> str:
    request = pb.RegisterRequest(
        address=f"127.0.0.1:{port}", pid=port, devices=["cpu"], store_port=port
    )
    response = stub.Register(request, timeout=5)
    LEASE_SECRETS[response.worker_id] = response.lease_secret
    return response.worker_id


def beat(worker_id: str, **fields: object) -> pb.HeartbeatRequest:
    """A HeartbeatRequest for ``worker_id`` carrying its lease secret."""
    return pb.HeartbeatRequest(
        worker_id=worker_id, lease_secret=LEASE_SECRETS.get(worker_id, ""), **fields
    )


class RawStream:
    """A HeartbeatStream call fed from a queue; a thread collects answers and the end."""

    def __init__(self, stub: pb_grpc.CoordinatorStub) -> None:
        self.requests: queue.SimpleQueue[pb.HeartbeatRequest | None] = queue.SimpleQueue()
        self.replies: list[pb.HeartbeatResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self.call = stub.HeartbeatStream(iter(self.requests.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            self.replies.extend(self.call)
        except grpc.RpcError as exc:
            self.error = exc
        self.ended.set()

    def send(self, worker_id: str, *, want_reply: bool = False) -> None:
        self.requests.put(beat(worker_id, joined_generation=1, want_reply=want_reply))

    def close(self) -> None:
        self.requests.put(None)


def state_of(stub: pb_grpc.CoordinatorStub, worker_id: str) -> int:
    cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=5)
    return next(w.state for w in cluster.workers if w.worker_id == worker_id)


def scrape(address: str) -> dict[str, float]:
    """{sample name: value} of the unlabelled samples at http://address/metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def beat_until(send: Callable[[], None], done: Callable[[], bool], timeout_s: float) -> None:
    """Calls ``send`` every heartbeat interval until ``done()``, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    period = threading.Event()  # never set: its wait is the heartbeat period, the workload
    while not done():
        assert time.monotonic() < deadline, f"not done after {timeout_s} s of heartbeats"
        send()
        period.wait(HEARTBEAT_S)


def cluster_ready(stub: pb_grpc.CoordinatorStub) -> bool:
    return stub.GetCluster(pb.GetClusterRequest(), timeout=5).ready


# ------------------------------------------------------------------ the RPC


def test_stream_renews_the_lease_and_answers_only_when_asked(
    stub: pb_grpc.CoordinatorStub,
) -> None:
    worker_id = register(stub)
    stream = RawStream(stub)
    sent: list[int] = []

    def send() -> None:
        stream.send(worker_id, want_reply=len(sent) % 5 == 0)
        sent.append(1)

    # Two leases' worth of beats, on the stream only: the worker stays live.
    beat_until(send, lambda: len(sent) >= 2 * LEASE_S / HEARTBEAT_S, 30)
    asked = (len(sent) + 4) // 5
    wait_until(lambda: len(stream.replies) == asked, 10, f"{asked} answers")
    assert state_of(stub, worker_id) == pb.WORKER_STATE_READY
    assert all(r.generation == 1 for r in stream.replies)
    versions = [r.version for r in stream.replies]
    assert versions == sorted(versions)
    stream.close()
    assert stream.ended.wait(10) and stream.error is None
    assert len(stream.replies) == asked  # nothing answered that was not asked


def test_unknown_worker_ends_the_stream_with_not_found(stub: pb_grpc.CoordinatorStub) -> None:
    stream = RawStream(stub)
    stream.send("no-such-worker")
    assert stream.ended.wait(10)
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.NOT_FOUND
    assert "register again" in stream.error.details()
    stream.close()


def test_stream_of_a_worker_declared_lost_is_cancelled(stub: pb_grpc.CoordinatorStub) -> None:
    worker_id = register(stub)
    ended = threading.Event()
    stream = HeartbeatStream(stub, reply_every_s=60, reply_timeout_s=5, on_end=ended.set)
    stream.send(beat(worker_id))  # the first beat asks for an answer
    wait_until(lambda: stream.last_reply is not None, 10, "the first answer")
    # Then silence on an open stream: the lease runs out, and the stream is cancelled.
    wait_until(
        lambda: state_of(stub, worker_id) == pb.WORKER_STATE_LOST, 10, "the worker declared lost"
    )
    assert ended.wait(10)
    with pytest.raises(grpc.RpcError) as cancelled:
        stream.send(beat(worker_id))
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED


def test_streams_beyond_the_limit_are_refused(stub: pb_grpc.CoordinatorStub) -> None:
    worker_id = register(stub)
    limit = coordinator_daemon.heartbeat_stream_limit(1)  # the coordinator runs --world-size 1
    streams = [HeartbeatStream(stub, reply_every_s=60, reply_timeout_s=5) for _ in range(limit)]
    try:
        for stream in streams:
            stream.send(beat(worker_id))
        wait_until(
            lambda: all(s.last_reply is not None for s in streams), 30, "every stream answered"
        )
        extra = RawStream(stub)
        extra.send(worker_id, want_reply=True)
        assert extra.ended.wait(10)
        assert extra.error is not None
        assert extra.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Heartbeat" in extra.error.details()
        extra.close()
        # The unary call still works for the worker that was refused a stream.
        stub.Heartbeat(beat(worker_id), timeout=5)
    finally:
        for stream in streams:
            stream.close()


def test_stopping_the_coordinator_ends_open_streams(coordinator: Daemon) -> None:
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        worker_id = register(stub)
        ended = threading.Event()
        stream = HeartbeatStream(stub, reply_every_s=60, reply_timeout_s=5, on_end=ended.set)
        stream.send(beat(worker_id))
        wait_until(lambda: stream.last_reply is not None, 10, "the first answer")
        coordinator.proc.terminate()
        assert coordinator.proc.wait(timeout=15) == 0
        assert ended.wait(10)
        with pytest.raises(grpc.RpcError) as gone:
            stream.send(beat(worker_id))
        assert gone.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


# ------------------------------------------------------------------ the worker daemon


def test_worker_heartbeats_on_a_stream_and_reregisters_after_a_coordinator_restart(
    tmp_path: Path,
) -> None:
    port, metrics = free_port(), free_port()
    args = ["--port", str(port), "--world-size", "1", "--metrics-port", str(metrics)]
    coordinator = start_coordinator(tmp_path, *args)
    worker = None
    try:
        worker = start_worker(tmp_path, coordinator.address)
        metrics_address = f"127.0.0.1:{metrics}"
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            wait_until(lambda: cluster_ready(stub), 60, "the worker READY")
            first = scrape(metrics_address)
            assert first["collectives_heartbeat_streams"] == 1
            wait_until(
                lambda: (
                    scrape(metrics_address)["collectives_heartbeats_received_total"]
                    >= first["collectives_heartbeats_received_total"] + 2 * LEASE_S / HEARTBEAT_S
                ),
                30,
                "two leases of heartbeats",
            )
            assert cluster_ready(stub)  # renewed by the stream all along
            old_id = stub.GetCluster(pb.GetClusterRequest(), timeout=5).workers[0].worker_id

        coordinator.kill()  # SIGKILL; a new one on the same port knows nobody
        coordinator = start_coordinator(tmp_path, *args)
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            wait_until(lambda: cluster_ready(stub), 60, "the worker registered again and READY")
            assert stub.GetCluster(pb.GetClusterRequest(), timeout=5).workers[0].worker_id != old_id
            wait_until(
                lambda: scrape(metrics_address)["collectives_heartbeat_streams"] == 1,
                30,
                "the worker back on a stream",
            )
    finally:
        if worker is not None:
            worker.kill()
        coordinator.kill()


def test_worker_falls_back_to_unary_heartbeats_when_streams_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A coordinator at its stream limit (here: no streams at all) answers every
    # HeartbeatStream with RESOURCE_EXHAUSTED; the worker must keep its lease anyway.
    monkeypatch.setattr(coordinator_daemon, "heartbeat_stream_limit", lambda max_workers: 0)
    config = CoordinatorConfig(
        min_workers=1,
        max_workers=1,
        heartbeat_s=HEARTBEAT_S,
        lease_s=LEASE_S,
        join_window_s=0.1,
        metrics_port=0,
    )
    with Coordinator(config) as coordinator:
        worker = start_worker(tmp_path, coordinator.address)
        try:
            metrics_address = coordinator.metrics_address
            assert metrics_address is not None
            wait_until(lambda: coordinator.cluster().ready, 60, "the worker READY")
            first = scrape(metrics_address)["collectives_heartbeats_received_total"]
            wait_until(
                lambda: (
                    scrape(metrics_address)["collectives_heartbeats_received_total"]
                    >= first + 2 * LEASE_S / HEARTBEAT_S
                ),
                30,
                "two leases of unary heartbeats",
            )
            assert coordinator.cluster().ready
            assert scrape(metrics_address)["collectives_heartbeat_streams"] == 0
            assert coordinator.cluster().workers[0].state == pb.WORKER_STATE_READY
        finally:
            worker.kill()
