"""Call lanes on real clusters: small calls over kept bulk-port connections, not gRPC calls.

What a lane must keep of gRPC: the same outputs (torch's), the same errors (class,
code, message, structured fields) as a ``--no-call-lanes`` cluster answers, the
call's deadline, the token check (a lane opens only with a ticket from an
authenticated call, once), a worker that survives garbage on a lane, and calls
that end in success or a clean error when a worker is killed under them. The
workers' ``collectives_call_lane_calls_total`` shows the calls took the lanes.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import status_pb2
from helpers import connect_ready, wait_until
from launcher import LocalCluster, free_port_block
from prometheus_client.parser import text_string_to_metric_families

import collectives
from collectives.errors import CollectiveError, DeadlineExceeded
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire.frames import (
    ACK,
    FAILED,
    FAILED_CLOSING,
    FRAME_HEADER,
    LANE,
    LANE_REQUEST_HEADER,
    MAX_LANE_REQUEST_BYTES,
    TOKEN_BYTES,
    prelude,
)
from collectives_server import model_zoo

ZOO = "collectives_server.model_zoo"
FACTORY = f"{ZOO}:mlp"
KWARGS = {"in_features": 16, "hidden": 64, "out_features": 8, "depth": 2, "seed": 11}
WORKERS = 2
CLIENTS = 8
TOKEN = "lane-token-for-tests"
pytestmark = pytest.mark.timeout(300)


def _lane_calls(first_port: int) -> float:
    """``collectives_call_lane_calls_total`` summed over the workers' /metrics."""
    total = 0.0
    for port in range(first_port, first_port + WORKERS):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "collectives_call_lane_calls_total":
                    total += sample.value
    return total


@pytest.fixture(scope="module")
def lanes_cluster(local_cluster) -> tuple[str, int]:
    """(address, metrics port of worker 0) of a 2-worker cluster serving call lanes."""
    base = free_port_block(WORKERS + 1)
    address = local_cluster(WORKERS, "--allow-factory", ZOO, "--metrics-port", str(base))
    return address, base + 1


@pytest.fixture(scope="module")
def grpc_cluster(local_cluster) -> str:
    """A 2-worker cluster whose workers serve no call lanes (every forward is gRPC)."""
    return local_cluster(WORKERS, "--allow-factory", ZOO, "--no-call-lanes")


def _loaded(address: str, name: str) -> collectives.Cluster:
    client = connect_ready(address, WORKERS)
    client.load_model(name, factory=FACTORY, kwargs=KWARGS)
    client.data_parallel(name).eval()
    return client


# Built once: the factory seeds torch's global generator, which threads would race on.
REFERENCE = model_zoo.mlp(**KWARGS).eval()


def _expected(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return REFERENCE(x)


def _assert_serves(client: collectives.Cluster, name: str, rows: int) -> None:
    """Loads the reference MLP as ``name`` and checks one forward of fresh rows."""
    client.load_model(name, factory=FACTORY, kwargs=KWARGS)
    client.data_parallel(name).eval()
    x = torch.randn(rows, KWARGS["in_features"])
    with torch.no_grad():
        got = client.data_parallel(name, timeout=60)(x)
    torch.testing.assert_close(got, _expected(x), atol=1e-5, rtol=1e-4)


def test_concurrent_forwards_take_the_lanes_and_equal_torch(lanes_cluster) -> None:
    """8 clients, fresh random inputs of 1 to 100 rows: each output is torch's on its
    rows, and every shard's Forward was answered on a lane."""
    address, metrics_port = lanes_cluster
    owner = _loaded(address, "lanes/equal")
    clients = [collectives.connect(address, timeout=60) for _ in range(CLIENTS)]
    before = _lane_calls(metrics_port)
    shards = [0] * CLIENTS
    failures: list[BaseException] = []
    start = threading.Barrier(CLIENTS)

    def work(i: int) -> None:
        try:
            dp = clients[i].data_parallel("lanes/equal", timeout=60)
            gen = torch.Generator().manual_seed(1000 + i)
            start.wait(30)
            for _ in range(12):
                rows = int(torch.randint(1, 101, (1,), generator=gen))
                x = torch.randn(rows, KWARGS["in_features"], generator=gen)
                with torch.no_grad():
                    got = dp(x)
                torch.testing.assert_close(got, _expected(x), atol=1e-5, rtol=1e-4)
                shards[i] += min(rows, WORKERS)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a client did not finish"
        assert not failures, failures[0]
        assert _lane_calls(metrics_port) - before == sum(shards)
    finally:
        for c in clients:
            c.close()
        owner.close()


def _failure(client: collectives.Cluster, call) -> CollectiveError:
    with pytest.raises(CollectiveError) as caught:
        call(client)
    return caught.value


def _fields(err: CollectiveError) -> tuple:
    return (type(err), err.code, err.message, err.reason, err.kind, err.tensor, err.executed)


def test_an_error_on_a_lane_is_the_error_grpc_gives(lanes_cluster, grpc_cluster) -> None:
    """Class, code, message and structured fields match a gRPC-only cluster's."""
    on_lanes = _loaded(lanes_cluster[0], "lanes/errors")
    on_grpc = _loaded(grpc_cluster, "lanes/errors")
    wrong_width = torch.randn(6, KWARGS["in_features"] + 3)

    def bad_shape(c: collectives.Cluster) -> None:
        with torch.no_grad():
            c.data_parallel("lanes/errors", timeout=30)(wrong_width)

    def unknown_model(c: collectives.Cluster) -> None:
        with torch.no_grad():
            c.data_parallel("lanes/not-loaded", timeout=30)(torch.randn(4, 16))

    try:
        for call in (bad_shape, unknown_model):
            lane_error = _failure(on_lanes, call)
            grpc_error = _failure(on_grpc, call)
            assert _fields(lane_error) == _fields(grpc_error)
        assert _fields(_failure(on_lanes, bad_shape))[1] == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        on_lanes.close()
        on_grpc.close()


def test_a_deadline_on_a_lane_ends_the_call_and_the_next_call_works(local_cluster) -> None:
    """A forward that cannot finish within its deadline ends in DeadlineExceeded at
    about the deadline; the client's next forward (a new lane) is correct."""
    address = local_cluster(WORKERS, "--allow-factory", ZOO)
    client = connect_ready(address, WORKERS)
    try:
        big = {"in_features": 512, "hidden": 4096, "out_features": 512, "depth": 3}
        client.load_model("lanes/slow", factory=FACTORY, kwargs=big)
        client.data_parallel("lanes/slow").eval()
        x = torch.randn(2048, 512)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded), torch.no_grad():
            client.data_parallel("lanes/slow", timeout=0.05)(x)
        assert time.monotonic() - started < 5.0
        _assert_serves(client, "lanes/fast", 10)
    finally:
        client.close()


# ------------------------------------------------------------ the raw protocol


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _closed_without_ack(sock: socket.socket) -> bool:
    """True when the worker closes the connection without acknowledging the lane."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _call(sock: socket.socket, method: int, payload: bytes) -> tuple[int, bytes]:
    sock.sendall(LANE_REQUEST_HEADER.pack(method, len(payload), 10.0) + payload)
    outcome, size = FRAME_HEADER.unpack(_recv_exactly(sock, FRAME_HEADER.size))
    return outcome, _recv_exactly(sock, size)


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A client of a plaintext 2-worker cluster with a bearer token."""
    directory = tmp_path_factory.mktemp("lane-token")
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    local = LocalCluster(
        WORKERS,
        ["--devices", "cpu", "--allow-factory", ZOO, f"--token-file={token_file}"],
        Path(directory) / "cluster.log",
    )
    local.start()
    client = collectives.connect(local.address, timeout=60, token=TOKEN)
    try:
        wait_until(
            lambda: (
                len([w for w in client.workers() if w.rank >= 0 and w.state == "ready"]) == WORKERS
            ),
            60,
            "2 ready workers",
        )
        yield client
    finally:
        client.close()
        local.stop()


def test_a_lane_opens_only_with_a_fresh_ticket_from_an_authenticated_call(token_cluster):
    client = token_cluster
    worker = next(w.address for w in client.workers() if w.rank == 0)
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(worker) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetDataPlane(worker_pb2.DataPlaneRequest(open_lane=True), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = stub.GetDataPlane(
            worker_pb2.DataPlaneRequest(open_lane=True), timeout=10, metadata=auth
        )
        plain = stub.GetDataPlane(worker_pb2.DataPlaneRequest(), timeout=10, metadata=auth)
    assert len(answer.lane_ticket) == TOKEN_BYTES and answer.bulk_port
    assert plain.lane_ticket == b""  # a ticket only for who asks for a lane
    host = worker.rpartition(":")[0]

    with socket.create_connection((host, answer.bulk_port), timeout=10) as guess:
        guess.sendall(prelude(LANE, os.urandom(TOKEN_BYTES)))
        assert _closed_without_ack(guess)
    with socket.create_connection((host, answer.bulk_port), timeout=10) as lane:
        lane.sendall(prelude(LANE, answer.lane_ticket))
        lane.settimeout(10)
        assert lane.recv(1) == ACK
    with socket.create_connection((host, answer.bulk_port), timeout=10) as replay:
        replay.sendall(prelude(LANE, answer.lane_ticket))  # spent: refused
        assert _closed_without_ack(replay)


def test_garbage_on_a_lane_gets_a_status_and_the_worker_goes_on(token_cluster) -> None:
    client = token_cluster
    worker = next(w.address for w in client.workers() if w.rank == 0)
    auth = (("authorization", f"Bearer {TOKEN}"),)

    def open_lane() -> socket.socket:
        with grpc.insecure_channel(worker) as channel:
            answer = worker_pb2_grpc.WorkerStub(channel).GetDataPlane(
                worker_pb2.DataPlaneRequest(open_lane=True), timeout=10, metadata=auth
            )
        sock = socket.create_connection((worker.rpartition(":")[0], answer.bulk_port), timeout=10)
        sock.sendall(prelude(LANE, answer.lane_ticket))
        assert sock.recv(1) == ACK
        return sock

    with open_lane() as lane:
        # A request that does not decode: INVALID_ARGUMENT, and the lane goes on.
        outcome, body = _call(lane, 1, b"\xff\xff\xff\xff not protobuf")
        status = status_pb2.Status.FromString(body)
        assert outcome == FAILED
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "malformed request" in status.message
        # A well-formed request for a model that is not there: NOT_FOUND with details.
        request = worker_pb2.ForwardRequest(model="lanes/none", call_id="c1")
        outcome, body = _call(lane, 1, request.SerializeToString())
        status = status_pb2.Status.FromString(body)
        assert outcome == FAILED and status.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert len(status.details) == 1  # the ErrorInfo a gRPC call carries
    with open_lane() as lane:
        outcome, body = _call(lane, 99, b"")
        assert outcome == FAILED_CLOSING
        assert status_pb2.Status.FromString(body).code == grpc.StatusCode.UNIMPLEMENTED.value[0]
        assert _closed_without_ack(lane)
    with open_lane() as lane:
        lane.sendall(LANE_REQUEST_HEADER.pack(1, MAX_LANE_REQUEST_BYTES + 1, 10.0))
        outcome, size = FRAME_HEADER.unpack(_recv_exactly(lane, FRAME_HEADER.size))
        status = status_pb2.Status.FromString(_recv_exactly(lane, size))
        assert outcome == FAILED_CLOSING
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert _closed_without_ack(lane)
    with open_lane() as lane:  # a frame cut short, then the connection closed
        lane.sendall(struct.pack("<B", 1))
    # The worker still answers, on lanes and correctly.
    _assert_serves(client, "lanes/after", 9)


@pytest.mark.timeout(240)
def test_a_worker_killed_under_8_clients_of_small_ops_ends_every_op_cleanly(fresh_cluster):
    """8 clients alternate forwards and 4-element all_reduces on lanes while a worker
    is killed: each op ends in the right result or a CollectiveError, none hangs, and
    once the survivor re-formed alone the ops succeed again."""
    local, owner = fresh_cluster(WORKERS, "--allow-factory", ZOO, "--min-workers", "1")
    owner.load_model("lanes/kill", factory=FACTORY, kwargs=KWARGS)
    owner.data_parallel("lanes/kill").eval()
    clients = [collectives.connect(local.address, timeout=60) for _ in range(CLIENTS)]
    # all_reduce(max) of a value that differs by rank: after the first, every rank
    # holds the maximum, which no later all_reduce (of any world) changes.
    maxima = []
    for i, c in enumerate(clients):
        parts = [torch.randn(4) for _ in range(WORKERS)]
        for rank, part in enumerate(parts):
            c.put(f"lanes/kill/{i}", part, rank=rank)
        maxima.append(torch.stack(parts).amax(0))
    victim = next(w for w in owner.workers() if w.rank == 1)
    assert local.owns(victim.pid)
    stop = threading.Event()
    killed = threading.Event()
    calls = [0] * CLIENTS
    after_kill = [0] * CLIENTS  # ops that started after the kill and succeeded
    wrong: list[str] = []
    errors: list[CollectiveError] = []

    def op(i: int, k: int, gen: torch.Generator) -> None:
        if k % 2:
            clients[i].all_reduce(f"lanes/kill/{i}", op="max", timeout=10)
            got = clients[i].get(f"lanes/kill/{i}", rank=0, timeout=10)
            if not torch.equal(got, maxima[i]):
                wrong.append(f"client {i}: all_reduce(max) gave {got}")
            return
        x = torch.randn(int(torch.randint(2, 40, (1,), generator=gen)), 16, generator=gen)
        with torch.no_grad():
            got = clients[i].data_parallel("lanes/kill", timeout=10)(x)
        if not torch.allclose(got, _expected(x), atol=1e-5, rtol=1e-4):
            wrong.append(f"client {i}: a wrong forward output")

    def work(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        for k in range(2000):
            if stop.is_set():
                return
            was_killed = killed.is_set()
            try:
                op(i, k, gen)
            except CollectiveError as err:
                errors.append(err)
                continue
            finally:
                calls[i] += 1
            if was_killed:
                after_kill[i] += 1

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: min(calls) >= 6, 60, "every client's first 6 ops")
        os.kill(victim.pid, signal.SIGKILL)
        killed.set()
        wait_until(lambda: min(after_kill) >= 4, 120, "4 correct ops per client after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
    assert not any(t.is_alive() for t in threads), "an op hung"
    assert not wrong, wrong[:3]
    for err in errors:
        assert err.code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ABORTED,
            grpc.StatusCode.NOT_FOUND,
        ), err


def test_the_workers_call_duration_bound_cancels_a_lane_call(local_cluster) -> None:
    """``--max-rpc-s`` ends a lane call as it ends a gRPC call: the client is told
    (CANCELLED, the SDK's DeadlineExceeded) long before the call's own deadline,
    and its next call works. The long model is small to load (the bound applies to
    the load too, whatever the machine's load) and slow to run: many rows, deep."""
    address = local_cluster(WORKERS, "--allow-factory", ZOO, "--max-rpc-s", "2")
    client = connect_ready(address, WORKERS)
    try:
        long = {"in_features": 1024, "hidden": 1024, "out_features": 16, "depth": 16}
        client.load_model("lanes/long", factory=FACTORY, kwargs=long)
        client.data_parallel("lanes/long").eval()
        client.load_model("lanes/short", factory=FACTORY, kwargs=KWARGS)
        client.data_parallel("lanes/short").eval()
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as ended, torch.no_grad():
            client.data_parallel("lanes/long", timeout=120)(torch.randn(32768, 1024))
        # Ended by the bound, not by the call's own 120 s deadline.
        assert time.monotonic() - started < 60, "the bound did not end the call"
        assert "cancelled" in ended.value.message
        y = torch.randn(7, KWARGS["in_features"])
        with torch.no_grad():
            got = client.data_parallel("lanes/short", timeout=60)(y)
        torch.testing.assert_close(got, _expected(y), atol=1e-5, rtol=1e-4)
    finally:
        client.close()
