"""The coordinator daemon over real gRPC: a child process, raw stubs, fake workers.

Each test starts ``python -m collectives_server coordinator --port 0`` (or the
installed ``collectives-server`` script), reads the address from its first stdout
line, and talks to it with the generated stubs. Waits follow the WatchCluster
stream (the coordinator pushes every change) under a deadline; nothing sleeps.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from launcher import Daemon, launch

from collectives.v1 import coordinator_pb2 as pb
from collectives.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

FAST = ["--heartbeat", "0.2", "--lease", "1", "--join-window", "0.1"]


def coordinator_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "collectives_server", "coordinator", "--port", "0", *args]


@pytest.fixture
def coordinator() -> Iterator[Daemon]:
    daemon = launch(coordinator_argv("--world-size", "2", *FAST))
    try:
        yield daemon
        assert daemon.terminate() == 0
    finally:
        daemon.kill()


@pytest.fixture
def stub(coordinator: Daemon) -> Iterator[pb_grpc.CoordinatorStub]:
    with grpc.insecure_channel(coordinator.address) as channel:
        yield pb_grpc.CoordinatorStub(channel)


class FakeWorker:
    """Registers like a worker and heartbeats from a thread until ``stop()``."""

    def __init__(self, stub: pb_grpc.CoordinatorStub, port: int) -> None:
        self.stub = stub
        self.address = f"127.0.0.1:{port}"
        response = stub.Register(
            pb.RegisterRequest(
                address=self.address, pid=port, devices=["cpu"], backend="gloo", store_port=port
            ),
            timeout=5,
        )
        self.worker_id = response.worker_id
        self.lease_secret = response.lease_secret
        self.interval_s = response.heartbeat_interval_s
        self.joined_generation = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):  # the heartbeat period, not a sync wait
            self.stub.Heartbeat(
                pb.HeartbeatRequest(
                    worker_id=self.worker_id,
                    joined_generation=self.joined_generation,
                    lease_secret=self.lease_secret,
                ),
                timeout=5,
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def watch_until(
    stub: pb_grpc.CoordinatorStub,
    predicate: Callable[[pb.Cluster], bool],
    what: str,
    timeout_s: float = 15.0,
) -> pb.Cluster:
    """Follows WatchCluster until a message satisfies ``predicate`` (deadline: ``timeout_s``)."""
    last = None
    stream = stub.WatchCluster(pb.WatchClusterRequest(after_version=0), timeout=timeout_s)
    try:
        for last in stream:
            if predicate(last):
                return last
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    finally:
        stream.cancel()
    raise AssertionError(f"timed out waiting for {what}; last cluster: {last}")


def by_id(cluster: pb.Cluster) -> dict[str, pb.WorkerInfo]:
    return {w.worker_id: w for w in cluster.workers}


def test_two_workers_seal_generation_then_one_is_lost(stub: pb_grpc.CoordinatorStub) -> None:
    first = stub.GetCluster(pb.GetClusterRequest(), timeout=5)
    assert first.generation == 0 and not first.formed
    assert first.status == "waiting for 2 more workers (0 live, min 2)"

    a, b = FakeWorker(stub, 6001), FakeWorker(stub, 6002)
    try:
        sealed = stub.GetCluster(pb.GetClusterRequest(), timeout=5)  # max reached: at once
        assert sealed.generation == 1 and sealed.formed and sealed.world_size == 2
        assert [(w.worker_id, w.rank) for w in sealed.workers] == [
            (a.worker_id, 0),
            (b.worker_id, 1),
        ]
        assert {w.state for w in sealed.workers} == {pb.WORKER_STATE_JOINING}
        assert sealed.store_address and sealed.min_workers == sealed.max_workers == 2

        a.joined_generation = b.joined_generation = 1
        ready = watch_until(stub, lambda c: c.ready, "both workers READY")
        assert ready.generation == 1
        assert {w.state for w in ready.workers} == {pb.WORKER_STATE_READY}
        assert ready.status == "generation 1 ready with 2 workers"

        b.stop()
        broken = watch_until(
            stub,
            lambda c: by_id(c)[b.worker_id].state == pb.WORKER_STATE_LOST,
            "the silent worker to be declared LOST",
        )
        assert by_id(broken)[b.worker_id].rank == -1
        assert not broken.formed and broken.generation == 1
        assert broken.status == "waiting for 1 more worker (1 live, min 2)"
        assert by_id(broken)[a.worker_id].state == pb.WORKER_STATE_JOINING

        with pytest.raises(grpc.RpcError) as lost:
            stub.Heartbeat(pb.HeartbeatRequest(worker_id=b.worker_id), timeout=5)
        assert lost.value.code() == grpc.StatusCode.NOT_FOUND
        assert "register again" in lost.value.details()

        # The lost worker registers again: a new id, and generation 2 re-forms.
        b2 = FakeWorker(stub, 6002)
        try:
            assert b2.worker_id != b.worker_id
            again = watch_until(stub, lambda c: c.formed, "generation 2")
            assert again.generation == 2
            assert [w.worker_id for w in again.workers if w.rank >= 0] == [
                a.worker_id,
                b2.worker_id,
            ]
        finally:
            b2.stop()
    finally:
        a.stop()
        b.stop()


def test_leave_and_bad_requests(stub: pb_grpc.CoordinatorStub) -> None:
    with pytest.raises(grpc.RpcError) as unknown:
        stub.Heartbeat(pb.HeartbeatRequest(worker_id="no-such-worker"), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as bad:
        stub.Register(pb.RegisterRequest(address="", devices=["cpu"]), timeout=5)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "HOST:PORT" in bad.value.details()
    with pytest.raises(grpc.RpcError) as no_devices:
        stub.Register(pb.RegisterRequest(address="127.0.0.1:7000"), timeout=5)
    assert no_devices.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    registered = stub.Register(
        pb.RegisterRequest(address="127.0.0.1:7000", devices=["cpu"], store_port=7001), timeout=5
    )
    worker_id = registered.worker_id
    stub.Leave(
        pb.LeaveRequest(worker_id=worker_id, lease_secret=registered.lease_secret), timeout=5
    )
    assert worker_id not in by_id(stub.GetCluster(pb.GetClusterRequest(), timeout=5))
    with pytest.raises(grpc.RpcError) as gone:
        stub.Leave(pb.LeaveRequest(worker_id=worker_id), timeout=5)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_and_reflection(coordinator: Daemon) -> None:
    with grpc.insecure_channel(coordinator.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "collectives.v1.Coordinator"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "collectives.v1.Coordinator" in services
        assert "grpc.health.v1.Health" in services


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_console_script_exits_zero_on_signal(sig: signal.Signals) -> None:
    script = shutil.which("collectives-server") or str(
        Path(sys.executable).parent / "collectives-server"
    )
    daemon = launch([script, "coordinator", "--port", "0", "--world-size", "1"])
    try:
        host, _, port = daemon.address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert daemon.terminate(sig) == 0
    finally:
        daemon.kill()


def test_bad_arguments_exit_2() -> None:
    result = subprocess.run(
        coordinator_argv("--min-workers", "3", "--max-workers", "2"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "max_workers (2) must be >= min_workers (3)" in result.stderr
    assert result.stdout == ""
