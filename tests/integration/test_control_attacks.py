"""Attacks on the coordinator's control plane, on real clusters: huge registration
fields, a rendezvous store reachable from other hosts, a dashboard held by idle
connections, and the coordinator's stream caps.

Every test starts a real ``local`` cluster (coordinator and two gloo workers as
subprocesses), captures the :class:`~hostile.Aftermath` baseline, attacks, and
then checks the refusal, the coordinator's health within 1 s, its RSS, and the
workers' health, memory and sentinel tensors.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from helpers import WORKER_TOKEN, wait_until
from hostile import Aftermath, MiB, assert_serving, rss_bytes
from launcher import free_port, listening_pid

import collectives
from collectives.v1 import coordinator_pb2 as pb
from collectives.v1 import coordinator_pb2_grpc as pb_grpc
from collectives.v1 import status_pb2
from collectives_server.control_protocol import WORKER_TOKEN_METADATA

WORKER = ((WORKER_TOKEN_METADATA, WORKER_TOKEN),)
GRPC_MAX_MESSAGE = 4 * MiB


def _coordinator_pid(local) -> int:
    """The pid of the coordinator that ``local`` (the launcher process) started."""
    pid = listening_pid(int(local.address.rpartition(":")[2]))
    assert pid is not None, f"no process listens on {local.address}"
    return pid


class CoordinatorAftermath:
    """The coordinator's side of the aftermath: health within 1 s, RSS back to baseline."""

    def __init__(self, local, slack_bytes: int = 32 * MiB) -> None:
        self.address = local.address
        self.pid = _coordinator_pid(local)
        self.slack = slack_bytes
        self.before = rss_bytes(self.pid)

    def check(self, deadline_s: float = 10.0) -> int:
        took = assert_serving(self.address, within_s=1.0)
        assert took < 1.0

        def settled() -> int | None:
            rss = rss_bytes(self.pid)
            return rss if rss <= self.before + self.slack else None

        return wait_until(
            settled,
            deadline_s,
            f"coordinator RSS back to {self.before / MiB:.0f} MiB (+{self.slack / MiB:.0f})",
        )


def _refused(call: Callable[[], object], code: grpc.StatusCode, *needles: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for needle in needles:
        assert needle in info.value.details(), info.value.details()
    return info.value.details()


# ----------------------------------------------------- huge registration fields


def test_huge_fields_are_refused_and_the_cluster_stays_usable(fresh_cluster) -> None:
    local, client = fresh_cluster(2)
    aftermath, coordinator = Aftermath(client).capture(), CoordinatorAftermath(local)
    with grpc.insecure_channel(local.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        base = {"address": "127.0.0.1:1", "devices": ["cpu"], "pid": 7}
        attacks = {
            "hostname": pb.RegisterRequest(**base, hostname="h" * (3 * MiB)),
            "address": pb.RegisterRequest(address="a" * 300 + ":1", devices=["cpu"], hostname="x"),
            "version": pb.RegisterRequest(**base, version="v" * 65),
            "backend": pb.RegisterRequest(**base, backend="b" * 17),
            "devices": pb.RegisterRequest(address="127.0.0.1:1", devices=["cpu"] * 65),
            "device": pb.RegisterRequest(address="127.0.0.1:1", devices=["d" * 65]),
        }
        for field, request in attacks.items():
            details = _refused(
                lambda r=request: stub.Register(r, timeout=10, metadata=WORKER), invalid, field
            )
            assert "limit" in details
        # A worker's status over 64 KiB is refused as well (the heartbeat, not the lease).
        # (A worker registers with the port of the rendezvous store it hosts.)
        registered = stub.Register(
            pb.RegisterRequest(address="127.0.0.1:2", devices=["cpu"], pid=8, store_port=2),
            timeout=10,
            metadata=WORKER,
        )
        fat = pb.HeartbeatRequest(
            worker_id=registered.worker_id,
            lease_secret=registered.lease_secret,
            status=status_pb2.WorkerStatus(last_op="s" * (65 * 1024)),
        )
        _refused(lambda: stub.Heartbeat(fat, timeout=10, metadata=WORKER), invalid, "status")
        stub.Leave(
            pb.LeaveRequest(worker_id=registered.worker_id, lease_secret=registered.lease_secret),
            timeout=10,
            metadata=WORKER,
        )
        # GetCluster still fits a gRPC message, and lists no attacker's field.
        cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=10)
        assert cluster.ByteSize() < GRPC_MAX_MESSAGE // 16
        assert all(len(w.hostname) <= 255 for w in cluster.workers)
        assert cluster.formed and cluster.world_size == 2
    # A new client connects and sees the cluster.
    with collectives.connect(local.address, timeout=30) as other:
        assert other.world_size == 2
    coordinator.check()
    aftermath.check()


def test_waiting_workers_are_capped(fresh_cluster) -> None:
    local, client = fresh_cluster(2, "--max-waiting-workers", "2")
    aftermath, coordinator = Aftermath(client).capture(), CoordinatorAftermath(local)
    with grpc.insecure_channel(local.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        waiting = []
        for i in range(2):  # the cluster is full (2 of 2): these wait for a place
            waiting.append(
                stub.Register(
                    pb.RegisterRequest(
                        address=f"127.0.0.1:{100 + i}", devices=["cpu"], pid=i, store_port=9
                    ),
                    timeout=10,
                    metadata=WORKER,
                )
            )
        extra = pb.RegisterRequest(address="127.0.0.1:200", devices=["cpu"], pid=99, store_port=9)
        _refused(
            lambda: stub.Register(extra, timeout=10, metadata=WORKER),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "--max-waiting-workers 2",
        )
        for r in waiting:
            stub.Leave(
                pb.LeaveRequest(worker_id=r.worker_id, lease_secret=r.lease_secret),
                timeout=10,
                metadata=WORKER,
            )
        cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=10)
        assert cluster.formed and cluster.world_size == 2
    coordinator.check()
    aftermath.check()


# ------------------------------------------- the store listens on loopback only


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of LISTEN sockets on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: TCP_LISTEN
                found.append(address)
    return found


def test_store_listens_on_loopback_only(fresh_cluster) -> None:
    local, _client = fresh_cluster(2)
    with grpc.insecure_channel(local.address) as channel:
        cluster = pb_grpc.CoordinatorStub(channel).GetCluster(pb.GetClusterRequest(), timeout=10)
    store_port = int(cluster.store_address.rsplit(":", 1)[1])
    listeners = _listening(store_port)
    assert listeners, f"nothing listens on the store port {store_port}"
    assert set(listeners) == {"0100007F"}, f"store listens on {listeners} (want 127.0.0.1 only)"
    # The coordinator's gRPC port too, for the record (gRPC may use the v4-mapped form).
    grpc_port = int(local.address.rsplit(":", 1)[1])
    assert set(_listening(grpc_port)) <= {"0100007F", "0000000000000000FFFF00000100007F"}


# ---------------------------------------- the dashboard under idle connections


def _healthz(port: int, timeout_s: float) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b"ok\n"
    finally:
        conn.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


# The dashboard's idle bound here: long enough that /healthz, asked once the crowd
# is connected, is answered while the crowd is still held on any machine's load.
IDLE_S = 8.0


def test_idle_dashboard_connections_are_closed(fresh_cluster) -> None:
    """120 idle connections (half with a request begun) do not starve /healthz: it is
    answered while all of them are still held; then the server closes every one
    once its idle bound passed, and /healthz still answers."""
    port = free_port()
    local, client = fresh_cluster(
        2, "--dashboard-port", str(port), "--dashboard-idle-s", str(IDLE_S)
    )
    aftermath, coordinator = Aftermath(client).capture(), CoordinatorAftermath(local)
    idle: list[socket.socket] = []
    try:
        for i in range(120):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:  # half of them start a request and never finish it
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            idle.append(sock)
        _healthz(port, IDLE_S / 2)
        for sock in idle:
            sock.settimeout(0.01)
        # Answered with the crowd still there (none of it closed yet): not starved.
        assert not any(_closed_by_peer(s) for s in idle), "the crowd was closed first"
        # Every idle connection is closed by the server once the idle timeout passed.
        for sock in idle:
            sock.settimeout(0.2)
        deadline = time.monotonic() + IDLE_S + 15
        pending = list(idle)
        while pending:
            assert time.monotonic() < deadline, f"{len(pending)} idle connections still open"
            pending = [s for s in pending if not _closed_by_peer(s)]
        _healthz(port, IDLE_S / 2)
    finally:
        for sock in idle:
            sock.close()
    coordinator.check()
    aftermath.check()


# ------------------------------------------------------------------ watch caps


def test_watch_streams_per_peer_are_capped(fresh_cluster) -> None:
    local, client = fresh_cluster(2, "--max-watch-streams-per-peer", "8")
    aftermath, coordinator = Aftermath(client).capture(), CoordinatorAftermath(local)
    with grpc.insecure_channel(local.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        streams = []
        refusal = None
        try:
            for _ in range(9):  # the SDK client's own watch stream already counts
                stream = stub.WatchCluster(pb.WatchClusterRequest(), timeout=60)
                try:
                    next(stream)
                except grpc.RpcError as exc:
                    refusal = exc
                    break
                streams.append(stream)
            assert refusal is not None, f"{len(streams)} streams opened past the cap of 8"
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # local raises the cap by its own workers' streams: 8 + 2 here.
            assert "--max-watch-streams-per-peer 10" in refusal.details()
            assert len(streams) <= 8
            assert stub.GetCluster(pb.GetClusterRequest(), timeout=5).formed
        finally:
            for stream in streams:
                stream.cancel()

        def watch_opens() -> bool:
            stream = stub.WatchCluster(pb.WatchClusterRequest(), timeout=5)
            try:
                next(stream)
                return True
            except grpc.RpcError:
                return False
            finally:
                stream.cancel()

        wait_until(watch_opens, 10, "a watch stream once the others were cancelled")
    coordinator.check()
    aftermath.check()
