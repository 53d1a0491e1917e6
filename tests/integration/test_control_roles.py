"""Workers and clients do not share one credential.

A real cluster (``local``: coordinator and two worker subprocesses, gloo) with a
client bearer token (``--token-file``) and a worker token (``--worker-token-file``).
A caller holding only the client token cannot Register, Heartbeat, HeartbeatStream
or Leave (PERMISSION_DENIED); a caller holding the worker token still cannot
register at a live worker's address (ALREADY_EXISTS, the live worker keeps its
place), nor heartbeat or leave for a worker without its lease secret
(PERMISSION_DENIED). Through all of it the legitimate cluster stays formed, ready,
healthy, and computes collectives on fresh random data.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from helpers import wait_until
from hostile import Aftermath, assert_serving
from launcher import LocalCluster, free_port, launch

import collectives
from collectives.v1 import coordinator_pb2 as pb
from collectives.v1 import coordinator_pb2_grpc as pb_grpc
from collectives.v1 import status_pb2
from collectives_server.control_protocol import WORKER_TOKEN_METADATA

WORKERS = 2
CLIENT_TOKEN = "client-token-for-role-tests"
WORKER_TOKEN = "worker-token-for-role-tests"
TIMEOUT_S = 30.0


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[LocalCluster, collectives.Cluster]]:
    client_file, worker_file = tmp_path / "client-token", tmp_path / "worker-token"
    for path, token in ((client_file, CLIENT_TOKEN), (worker_file, WORKER_TOKEN)):
        path.write_text(token + "\n")
        path.chmod(0o600)
    local = LocalCluster(
        WORKERS,
        [
            "--devices=cpu",
            "--heartbeat=0.5",
            "--lease=3",
            f"--token-file={client_file}",
            f"--worker-token-file={worker_file}",
        ],
        tmp_path / "roles.log",
    )
    local.start()
    try:
        client = collectives.connect(local.address, timeout=60, token=CLIENT_TOKEN)
        try:
            wait_until(lambda: _ready(client), 60, f"{WORKERS} ready workers")
            yield local, client
        finally:
            client.close()
    finally:
        local.stop()


def _ready(client: collectives.Cluster) -> bool:
    members = [w for w in client.workers() if w.rank >= 0]
    return len(members) == WORKERS and all(w.state == "ready" for w in members)


def _client_only() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {CLIENT_TOKEN}"),)


def _worker() -> tuple[tuple[str, str], ...]:
    return (*_client_only(), (WORKER_TOKEN_METADATA, WORKER_TOKEN))


def _refused(call: Callable[[], object], code: grpc.StatusCode, *needles: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for needle in needles:
        assert needle in info.value.details()
    return info.value.details()


def _members(stub: pb_grpc.CoordinatorStub) -> tuple[int, list[tuple[str, str, int]]]:
    cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=10, metadata=_client_only())
    rows = [(w.worker_id, w.address, w.state) for w in cluster.workers if w.rank >= 0]
    return cluster.generation, rows


def _forged_status() -> status_pb2.WorkerStatus:
    return status_pb2.WorkerStatus(last_op="forged", tensors_held=12345)


def _assert_coordinator_healthy(address: str) -> None:
    assert assert_serving(address, within_s=1.0, token=CLIENT_TOKEN) < 1.0


def test_client_token_alone_cannot_act_as_a_worker(secured) -> None:
    local, client = secured
    aftermath = Aftermath(client).capture()
    with grpc.insecure_channel(local.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        generation, before = _members(stub)
        victim_id = before[0][0]
        denied = grpc.StatusCode.PERMISSION_DENIED
        register = pb.RegisterRequest(address="127.0.0.1:1", devices=["cpu"], pid=4242)
        _refused(
            lambda: stub.Register(register, timeout=10, metadata=_client_only()),
            denied,
            "Register",
            "workers only",
        )
        beat = pb.HeartbeatRequest(worker_id=victim_id, busy=True, status=_forged_status())
        _refused(
            lambda: stub.Heartbeat(beat, timeout=10, metadata=_client_only()), denied, "Heartbeat"
        )
        _refused(
            lambda: list(stub.HeartbeatStream(iter([beat]), timeout=10, metadata=_client_only())),
            denied,
            "HeartbeatStream",
        )
        leave = pb.LeaveRequest(worker_id=victim_id)
        _refused(lambda: stub.Leave(leave, timeout=10, metadata=_client_only()), denied, "Leave")
        # A wrong worker token is no better than none.
        wrong = (*_client_only(), (WORKER_TOKEN_METADATA, "not-the-worker-token"))
        _refused(
            lambda: stub.Leave(leave, timeout=10, metadata=wrong), denied, "invalid worker token"
        )
        # Nothing changed: same generation, same members, still ready; the forged
        # status never reached the cluster listing.
        assert _members(stub) == (generation, before)
        cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=10, metadata=_client_only())
        assert all(w.status.last_op != "forged" for w in cluster.workers)
    _assert_coordinator_healthy(local.address)
    aftermath.check(token=CLIENT_TOKEN)


def test_register_at_a_live_workers_address_is_refused(secured) -> None:
    local, client = secured
    aftermath = Aftermath(client).capture()
    with grpc.insecure_channel(local.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        generation, before = _members(stub)
        victim_id, victim_address, _ = before[0]
        # Another process (any pid, hostname, retry key) at the live worker's address.
        for pid, retry_key in ((999_999, ""), (999_998, "guessed-retry-key")):
            hijack = pb.RegisterRequest(
                address=victim_address, devices=["cpu"], pid=pid, retry_key=retry_key
            )
            _refused(
                lambda hijack=hijack: stub.Register(hijack, timeout=10, metadata=_worker()),
                grpc.StatusCode.ALREADY_EXISTS,
                victim_address,
                victim_id,
            )
        # The live worker keeps its id, its rank and its READY state.
        assert _members(stub) == (generation, before)
        assert all(state == pb.WORKER_STATE_READY for _, _, state in before)
    _assert_coordinator_healthy(local.address)
    aftermath.check(token=CLIENT_TOKEN)


def test_forged_heartbeat_and_leave_without_the_lease_secret_are_refused(secured) -> None:
    local, client = secured
    aftermath = Aftermath(client).capture()
    with grpc.insecure_channel(local.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        generation, before = _members(stub)
        victim_id = before[1][0]
        denied = grpc.StatusCode.PERMISSION_DENIED
        for secret in ("", "a-guessed-lease-secret"):
            beat = pb.HeartbeatRequest(
                worker_id=victim_id, lease_secret=secret, busy=True, status=_forged_status()
            )
            _refused(
                lambda beat=beat: stub.Heartbeat(beat, timeout=10, metadata=_worker()),
                denied,
                "lease_secret",
            )
            _refused(
                lambda beat=beat: list(
                    stub.HeartbeatStream(iter([beat]), timeout=10, metadata=_worker())
                ),
                denied,
                "lease_secret",
            )
            leave = pb.LeaveRequest(worker_id=victim_id, lease_secret=secret)
            _refused(
                lambda leave=leave: stub.Leave(leave, timeout=10, metadata=_worker()),
                denied,
                "lease_secret",
            )
        assert _members(stub) == (generation, before)
        cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=10, metadata=_client_only())
        victim = next(w for w in cluster.workers if w.worker_id == victim_id)
        assert victim.state == pb.WORKER_STATE_READY and victim.status.last_op != "forged"
    _assert_coordinator_healthy(local.address)
    aftermath.check(token=CLIENT_TOKEN)


def test_legitimate_workers_form_the_cluster_and_compute(secured, gen) -> None:
    _local, client = secured
    tensors = [torch.randn(64, 33, generator=gen) for _ in range(WORKERS)]
    for rank, tensor in enumerate(tensors):
        client.put("roles/x", tensor, rank=rank)
    client.all_reduce("roles/x", timeout=TIMEOUT_S)
    expected = torch.stack(tensors).sum(dim=0)
    for rank in range(WORKERS):
        torch.testing.assert_close(client.get("roles/x", rank=rank), expected)


# ------------------------------------------------------------------ the worker daemon


def _worker_argv(coordinator: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "collectives_server", "worker", f"--coordinator={coordinator}",
        "--host=127.0.0.1", f"--port={port}", "--devices=cpu", *extra,
    ]  # fmt: skip


def _live_ids(stub: pb_grpc.CoordinatorStub) -> list[str]:
    cluster = stub.GetCluster(pb.GetClusterRequest(), timeout=5)
    return [w.worker_id for w in cluster.workers if w.state == pb.WORKER_STATE_READY]


def _coordinator(tmp_path: Path, token_flag: str, lease_s: float):
    return launch(
        [
            sys.executable, "-m", "collectives_server", "coordinator", "--world-size=1",
            "--heartbeat=0.5", f"--lease={lease_s:g}", "--join-window=0.1", token_flag,
        ],
        tmp_path / "coordinator.log",
    )  # fmt: skip


def _token_flag(tmp_path: Path) -> str:
    worker_file = tmp_path / "worker-token"
    worker_file.write_text(WORKER_TOKEN)
    worker_file.chmod(0o600)
    return f"--worker-token-file={worker_file}"


def test_worker_daemon_needs_the_worker_token_and_waits_out_a_silent_predecessor(
    tmp_path: Path,
) -> None:
    token_flag = _token_flag(tmp_path)
    coordinator = _coordinator(tmp_path, token_flag, 6)
    worker = None
    try:
        # Without the worker token, the worker is refused at once and exits 1.
        refused = subprocess.run(
            _worker_argv(coordinator.address, 0),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 1
        assert "PERMISSION_DENIED" in refused.stderr.upper() or "workers only" in refused.stderr

        port = free_port()
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            # A predecessor at the address that went silent without leaving, whose end
            # the coordinator cannot see (no heartbeat stream closed: a host that died).
            predecessor = stub.Register(
                pb.RegisterRequest(
                    address=f"127.0.0.1:{port}", devices=["cpu"], pid=4242, store_port=1
                ),
                timeout=10,
                metadata=((WORKER_TOKEN_METADATA, WORKER_TOKEN),),
            ).worker_id
            started = time.monotonic()
            worker = launch(
                _worker_argv(coordinator.address, port, token_flag), tmp_path / "w1.log"
            )
            wait_until(lambda: _live_ids(stub) not in ([], [predecessor]), 60, "the worker READY")
            assert time.monotonic() - started < 30
        # The worker was refused (ALREADY_EXISTS) while its predecessor's lease ran (its
        # start-up takes well under the 6 s lease), and retried.
        log = (tmp_path / "coordinator.log").read_text()
        assert f"address '127.0.0.1:{port}' is held by live worker {predecessor}" in log
    finally:
        if worker is not None:
            worker.kill()
        coordinator.kill()


def test_a_killed_worker_is_seen_at_once_and_its_restart_registers(tmp_path: Path) -> None:
    """Its heartbeat stream closes and its port refuses connections: lost now, not
    after the lease (30 s here), so a restart on the same address registers at once."""
    token_flag = _token_flag(tmp_path)
    coordinator = _coordinator(tmp_path, token_flag, 30)
    port = free_port()
    worker = launch(_worker_argv(coordinator.address, port, token_flag), tmp_path / "w1.log")
    try:
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            wait_until(lambda: len(_live_ids(stub)) == 1, 60, "the worker READY")
            (first,) = _live_ids(stub)
            worker.kill()
            worker = launch(
                _worker_argv(coordinator.address, port, token_flag), tmp_path / "w2.log"
            )
            # Well within the 30 s lease: only the crash probe can have freed the address.
            wait_until(lambda: _live_ids(stub) not in ([], [first]), 20, "the restart READY")
        log = (tmp_path / "coordinator.log").read_text()
        # Never refused for its predecessor's address, as it was while leases decided.
        assert "is held by live worker" not in log, log[-3000:]
    finally:
        worker.kill()
        coordinator.kill()
