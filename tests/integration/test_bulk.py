"""The bulk data plane: large put/get payloads over raw TCP beside gRPC.

Round trips through the SDK (bit-exact, every dtype family, sizes around the
1 MiB threshold), then the protocol spoken by hand with a raw stub and a raw
socket: a missing connection, a short payload, a wrong or replayed ticket, a
refused put, a ticket in the wrong shape. Every failure is a clear status,
nothing is stored, and the worker lives on.
"""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest
import torch
from helpers import CONNECT_TIMEOUT_S, wait_until

import collectives
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from collectives.wire import codec
from collectives.wire.dtypes import to_wire
from collectives.wire.frames import BULK, new_token, prelude

MiB = 1 << 20


def _members(address: str) -> list:
    cluster = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(address)).GetCluster(
        coordinator_pb2.GetClusterRequest(), timeout=10
    )
    return sorted((w for w in cluster.workers if w.rank >= 0), key=lambda w: w.rank)


@pytest.fixture(scope="module")
def rank0(cluster2, cluster2_address):
    """(stub, host, bulk port, pid) of rank 0 of the shared 2-worker cluster (once formed)."""
    address = _members(cluster2_address)[0].address
    channel = grpc.insecure_channel(address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    plane = stub.GetDataPlane(worker_pb2.DataPlaneRequest(), timeout=10)
    pid = stub.GetState(worker_pb2.GetStateRequest(), timeout=10).pid
    yield stub, address.rpartition(":")[0], plane.bulk_port, pid
    channel.close()


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(dtype)


def test_workers_offer_a_bulk_port(rank0) -> None:
    _, _, port, _ = rank0
    assert 0 < port < 65536


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (torch.float32, (MiB // 4 - 1,)),  # just under the threshold: gRPC stream / inline
        (torch.float32, (MiB // 4,)),  # exactly 1 MiB: bulk
        (torch.float64, (3, 177, 1031)),  # odd sizes
        (torch.bfloat16, (5, 333, 1025)),
        (torch.complex64, (257, 2049)),
        (torch.int64, (1 << 18, 3)),
        (torch.bool, (3 * MiB + 7,)),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_round_trip_is_bit_exact(cluster2, uname, gen, dtype, shape) -> None:
    t = _random(shape, dtype, gen)
    name = uname("bulk")
    cluster2.put(name, t, rank=1)
    back = cluster2.get(name, rank=1)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
    cluster2.delete(name)


def test_non_contiguous_and_every_rank(cluster2, uname, gen) -> None:
    t = torch.randn(1024, 1536, generator=gen).t()[::2]  # 3 MiB, strided
    name = uname("strided")
    cluster2.put(name, t)  # every rank, in parallel
    for rank in (0, 1):
        assert torch.equal(cluster2.get(name, rank=rank), t)
    cluster2.delete(name)


def _put_call(stub, name: str, nbytes: int, ticket: bytes, timeout: float):
    header = worker_pb2.PutTensorBulkRequest(
        header=dict(name=name, dtype=to_wire(torch.uint8), shape=[nbytes], nbytes=nbytes),
        ticket=ticket,
    )
    return stub.PutTensorBulk.future(header, timeout=timeout)


def _exists(stub, name: str) -> bool:
    listed = stub.ListTensors(worker_pb2.ListTensorsRequest(), timeout=10).tensors
    return any(info.name == name for info in listed)


def _connect(host: str, port: int, prelude: bytes) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=20)
    sock.sendall(prelude)
    return sock


def test_put_without_a_connection_times_out_and_stores_nothing(rank0, uname) -> None:
    stub, _, _, pid = rank0
    name = uname("orphan")
    call = _put_call(stub, name, 2 * MiB, new_token(), timeout=1.0)
    with pytest.raises(grpc.RpcError) as info:
        call.result(timeout=30)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not _exists(stub, name)
    os.kill(pid, 0)


def test_short_payload_is_invalid_and_stores_nothing(rank0, uname) -> None:
    stub, host, port, pid = rank0
    name, ticket = uname("short"), new_token()
    call = _put_call(stub, name, 2 * MiB, ticket, timeout=30)
    with _connect(host, port, prelude(BULK, ticket)) as sock:
        sock.sendall(os.urandom(MiB))  # half of what the header declares
    with pytest.raises(grpc.RpcError) as info:
        call.result(timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "closed after 1048576 of 2097152 bytes" in info.value.details()
    assert not _exists(stub, name)
    os.kill(pid, 0)


def test_a_ticket_of_the_wrong_size_is_invalid(rank0, uname) -> None:
    stub, _, _, _ = rank0
    call = _put_call(stub, uname("t"), 2 * MiB, b"short", timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        call.result(timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "16 bytes" in info.value.details()


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_garbage_and_replayed_tickets_are_dropped(rank0, uname, gen) -> None:
    stub, host, port, pid = rank0
    with _connect(host, port, b"GET / HTTP/1.1\r\n\r\n") as sock:
        assert _closed_by_peer(sock)
    name = uname("replay")
    t = torch.randint(0, 255, (2 * MiB,), dtype=torch.uint8, generator=gen)
    stub_put = _put_call(stub, name, t.numel(), ticket := new_token(), timeout=30)
    with _connect(host, port, prelude(BULK, ticket)) as sock:
        sock.sendall(codec.tensor_memoryview(t))
    stub_put.result(timeout=30)
    answer = stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name=name), timeout=30)
    assert answer.ticket and not answer.inline_data and answer.header.nbytes == t.numel()
    received = bytearray()
    with _connect(host, port, prelude(BULK, answer.ticket)) as sock:
        while len(received) < t.numel() and (chunk := sock.recv(1 << 20)):
            received += chunk
    assert bytes(received) == codec.tensor_memoryview(t).tobytes()
    start = time.monotonic()
    with _connect(host, port, prelude(BULK, answer.ticket)) as sock:  # the same ticket again
        assert _closed_by_peer(sock)
    assert time.monotonic() - start < 5, "a spent ticket must be refused at once"
    stub.DeleteTensor(worker_pb2.DeleteTensorRequest(name=name), timeout=10)
    os.kill(pid, 0)


def test_small_tensors_come_back_inline(rank0, cluster2, uname, gen) -> None:
    stub, _, _, _ = rank0
    name = uname("small")
    t = torch.randn(100, generator=gen)
    cluster2.put(name, t, rank=0)
    answer = stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name=name), timeout=30)
    assert not answer.ticket and len(answer.inline_data) == 400
    assert torch.equal(torch.frombuffer(bytearray(answer.inline_data), dtype=torch.float32), t)
    with pytest.raises(grpc.RpcError) as info:
        stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name=uname("nothing")), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    cluster2.delete(name)


def test_a_refused_put_stops_the_sender_at_once(local_cluster, uname) -> None:
    """Over quota: the call fails before any byte is read, and the client does
    not wait for the whole payload to drain (nor for a deadline)."""
    address = local_cluster(1, "--max-tensor-bytes", "4MiB")
    with collectives.connect(address, timeout=CONNECT_TIMEOUT_S) as client:
        wait_until(lambda: client.world_size == 1, CONNECT_TIMEOUT_S, "1 worker")
        start = time.monotonic()
        with pytest.raises(collectives.ResourceExhausted):
            client.put(uname("big"), torch.randn(64 * MiB // 4), rank=0, timeout=60)
        assert time.monotonic() - start < 10
        ok = torch.randn(MiB // 2)  # 2 MiB fits, still through the bulk port
        client.put(uname("ok"), ok, rank=0)


def test_no_bulk_workers_stream_everything(local_cluster, uname, gen) -> None:
    address = local_cluster(1, "--no-bulk")
    with collectives.connect(address, timeout=CONNECT_TIMEOUT_S) as client:
        wait_until(lambda: client.world_size == 1, CONNECT_TIMEOUT_S, "1 worker")
        (member,) = _members(address)
        with grpc.insecure_channel(member.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            assert stub.GetDataPlane(worker_pb2.DataPlaneRequest(), timeout=10).bulk_port == 0
            with pytest.raises(grpc.RpcError) as info:
                stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name="x"), timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        t = torch.randn(3 * MiB // 4, generator=gen)
        name = uname("streamed")
        client.put(name, t, rank=0)
        assert torch.equal(client.get(name, rank=0), t)
