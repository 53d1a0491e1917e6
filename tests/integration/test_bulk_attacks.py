"""The bulk port cannot be filled, stalled or made to pin memory.

Idle TCP connections filled the 256 bulk slots and a new client's put timed
out; now each host gets at most ``--max-bulk-connections-per-peer``, idle ones
are closed after ``--bulk-prelude-timeout-s`` and the SDK sends through the
gRPC stream while the bulk port refuses it. The prelude timeout was per
byte; now it is total. A GET ticket pinned its tensor for the call's
deadline; now for at most ``--bulk-ticket-ttl-s``. ``PutTensorBulk``
without a deadline waited 24 h; now at most the ticket TTL for its connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time

import grpc
import pytest
import torch
from hostile import Aftermath

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire import codec
from collectives.wire.frames import BULK, new_token, prelude

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(180)

FLAGS = (
    "--bulk-ticket-ttl-s", "2", "--bulk-prelude-timeout-s", "1",
    "--max-bulk-connections-per-peer", "16",
)  # fmt: skip


@pytest.fixture
def client(local_cluster):
    """A connection to this module's cluster, shared by the attacks with its flags:
    each leaves it as it found it (its Aftermath checks so)."""
    with collectives.connect(local_cluster(2, *FLAGS), timeout=60) as connected:
        yield connected


def _target(client):
    return max((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)


def _bulk_port(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return int(stub.GetDataPlane(worker_pb2.DataPlaneRequest(), timeout=10).bulk_port)


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """How long until the server closed ``sock`` (None: still open after ``seconds``)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - started


def test_idle_connections_cannot_lock_a_client_out(client, gen) -> None:
    aftermath = Aftermath(client).capture()
    target = _target(client)
    port = _bulk_port(target.address)
    idle: list[socket.socket] = []
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        for nbytes in (2 << 20, 64 << 20):  # through the bulk port or, refused, the stream
            t = torch.randn(nbytes // 4, generator=gen)
            started = time.monotonic()
            client.put("idle/x", t, rank=target.rank, timeout=30)
            assert torch.equal(client.get("idle/x", rank=target.rank, timeout=30), t)
            log.info(
                f"{nbytes >> 20} MiB put+get beside 300 idle connections: "
                f"{time.monotonic() - started:.2f} s"
            )
        client.delete("idle/x", rank=target.rank)
        # Every idle connection is closed by the worker within the prelude timeout.
        waits = [_closed_within(s, 5.0) for s in idle]
        assert all(w is not None for w in waits), f"{waits.count(None)} still open"
    finally:
        for sock in idle:
            sock.close()
    aftermath.check()


def test_a_dribbled_prelude_is_cut_at_the_total_timeout(client) -> None:
    aftermath = Aftermath(client).capture()
    port = _bulk_port(_target(client).address)
    opening = prelude(BULK, new_token())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        closed = False
        for byte in opening:  # one byte every 0.2 s: 4 s in all, past the 1 s total
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        took = time.monotonic() - started
    assert closed and took < 2.5, f"closed={closed} after {took:.2f} s"
    aftermath.check()


def test_a_get_ticket_pins_its_tensor_for_the_ttl_only(client, gen) -> None:
    aftermath = Aftermath(client).capture()
    target = _target(client)
    client.put("ticket/x", torch.randn(8 << 20, generator=gen), rank=target.rank)
    with grpc.insecure_channel(target.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        reply = stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name="ticket/x"))  # no deadline
    assert reply.ticket and reply.ticket_ttl_s <= 2.0, reply.ticket_ttl_s
    client.delete("ticket/x", rank=target.rank)
    deadline = time.monotonic() + 10
    while True:  # after the TTL the ticket is void: the connection gets no byte
        with socket.create_connection(("127.0.0.1", _bulk_port(target.address))) as sock:
            sock.sendall(prelude(BULK, reply.ticket))
            sock.settimeout(5)
            got = sock.recv(1 << 16)
        if not got:
            break
        assert time.monotonic() < deadline, "the ticket still served after its TTL"
    aftermath.check()  # RSS back: the 32 MiB tensor is not pinned by the ticket


def test_put_tensor_bulk_without_a_deadline_ends_at_the_ticket_ttl(client, gen) -> None:
    aftermath = Aftermath(client).capture()
    target = _target(client)
    t = torch.randn(1 << 20, generator=gen)
    request = worker_pb2.PutTensorBulkRequest(
        header=codec.make_header("nodeadline/x", t), ticket=new_token()
    )
    started = time.monotonic()
    # No deadline, and no connection ever presents the ticket.
    with grpc.insecure_channel(target.address) as channel, pytest.raises(grpc.RpcError) as info:
        worker_pb2_grpc.WorkerStub(channel).PutTensorBulk(request)
    took = time.monotonic() - started
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
    assert "--bulk-ticket-ttl-s" in info.value.details() and took < 6, took
    aftermath.check()


def test_tickets_count_against_the_quota_and_a_full_quota_still_reads(fresh_cluster, gen) -> None:
    _, client = fresh_cluster(2, *FLAGS, "--max-tensor-bytes", "56MiB")
    aftermath = Aftermath(client).capture()
    target = _target(client)
    t = torch.randn(4 << 20, generator=gen)  # 16 MiB
    client.put("m2q/x", t, rank=target.rank)
    with grpc.insecure_channel(target.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        # An attacker draws tickets and never uses them: each holds 16 MiB of quota...
        stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name="m2q/x"), timeout=10)
        stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name="m2q/x"), timeout=10)
        with pytest.raises(grpc.RpcError) as info:  # ...until the quota is spent
            stub.GetTensorBulk(worker_pb2.GetTensorBulkRequest(name="m2q/x"), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A legitimate client still reads it (the SDK streams when no ticket fits).
    assert torch.equal(client.get("m2q/x", rank=target.rank), t)
    client.delete("m2q/x")
    aftermath.check()  # the tickets expired after their TTL and gave their quota back
