"""Resource limits: the per-worker store quota (--max-tensor-bytes) and the
bounded op queue (--queue-size). Exceeding either answers RESOURCE_EXHAUSTED,
refuses before allocating, commits nothing, and kills nothing."""

from __future__ import annotations

import argparse
import logging
import os
import signal

import grpc
import pytest
import torch
from helpers import CONNECT_TIMEOUT_S, wait_until
from launcher import stop_process

import collectives
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from collectives.wire import codec
from collectives_server.settings import byte_size

QUOTA = 8 << 20  # bytes per worker
QUEUE = 2


@pytest.fixture(scope="module")
def limited_address(local_cluster) -> str:
    return local_cluster(2, "--max-tensor-bytes", "8MiB", "--queue-size", str(QUEUE))


@pytest.fixture(scope="module")
def limited(limited_address):
    address = limited_address
    client = collectives.connect(address, timeout=CONNECT_TIMEOUT_S)
    wait_until(
        lambda: (
            client.world_size == 2
            and all(w.state == "ready" for w in client.workers() if w.rank >= 0)
        ),
        CONNECT_TIMEOUT_S,
        "2 ready workers",
    )
    cluster = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(address)).GetCluster(
        coordinator_pb2.GetClusterRequest(), timeout=10
    )
    members = sorted((w for w in cluster.workers if w.rank >= 0), key=lambda w: w.rank)
    channels = [grpc.insecure_channel(w.address) for w in members]
    yield client, channels
    for c in channels:
        c.close()
    client.close()


@pytest.fixture
def clean(limited):
    client, channels = limited
    yield client, channels
    for stub in (worker_pb2_grpc.WorkerStub(c) for c in channels):
        for info in stub.ListTensors(worker_pb2.ListTensorsRequest(), timeout=10).tensors:
            stub.DeleteTensor(worker_pb2.DeleteTensorRequest(name=info.name), timeout=10)


def _pids(channels) -> list[int]:
    return [
        worker_pb2_grpc.WorkerStub(c).GetState(worker_pb2.GetStateRequest(), timeout=10).pid
        for c in channels
    ]


def _alive(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, 0)  # raises ProcessLookupError if the worker died


def _bytes_held(channels) -> list[int]:
    return [
        worker_pb2_grpc.WorkerStub(c).GetState(worker_pb2.GetStateRequest(), timeout=10).bytes_held
        for c in channels
    ]


def test_byte_size_parses_units() -> None:
    assert byte_size("1048576") == 1 << 20
    assert byte_size("8MiB") == 8 << 20
    assert byte_size("2G") == 2_000_000_000
    for bad in ("", "-1", "0", "12parsecs", "MiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_put_beyond_the_quota_is_refused(clean, uname) -> None:
    client, channels = clean
    pids = _pids(channels)
    keep = torch.randn(1 << 20)  # 4 MiB
    client.put(uname("a"), keep, rank=0)
    with pytest.raises(collectives.ResourceExhausted) as info:
        client.put(uname("b"), torch.randn(5 << 18), rank=0)  # 5 MiB: 9 MiB > 8 MiB
    assert f"its limit is {QUOTA}" in info.value.message
    # Replacing counts the old value out: 4 MiB → 6 MiB under the same name fits.
    name = uname("grow")
    client.put(name, torch.randn(1 << 20), rank=1)
    client.put(name, torch.randn(6 << 18), rank=1)
    assert _bytes_held(channels) == [4 << 20, 6 << 20]
    _alive(pids)


def test_huge_declared_tensor_is_refused_before_allocating(clean, uname) -> None:
    """A header declaring 512 GiB (under the codec's 1 TiB sanity bound) is
    refused by the quota at once; allocating it first would kill the worker."""
    _, channels = clean
    pids = _pids(channels)
    nbytes = 512 << 30
    header = worker_pb2.PutTensorRequest(
        header=dict(name=uname("huge"), dtype=9, shape=[nbytes], nbytes=nbytes)
    ).SerializeToString()
    call = channels[0].stream_unary(
        "/collectives.v1.Worker/PutTensor",
        request_serializer=None,
        response_deserializer=worker_pb2.PutTensorResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        call(iter([header, codec.frame_chunk(b"\0" * 1024)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit is" in info.value.details()
    _alive(pids)


def test_collective_result_beyond_the_quota_fails_on_every_rank(clean, uname) -> None:
    client, channels = clean
    pids = _pids(channels)
    name, out = uname("x"), uname("gathered")
    parts = [torch.randn(3 << 18) for _ in range(2)]  # 3 MiB each
    for rank, part in enumerate(parts):
        client.put(name, part, rank=rank)
    # all_gather stores 2 x 3 MiB under out next to the 3 MiB operand: 9 MiB > 8 MiB.
    with pytest.raises(collectives.ResourceExhausted) as info:
        client.all_gather(name, out=out)
    assert "limit is" in info.value.message and "failed on rank(s) 0, 1" in info.value.message
    assert _bytes_held(channels) == [3 << 20, 3 << 20]  # nothing committed anywhere
    for c in channels:
        listed = worker_pb2_grpc.WorkerStub(c).ListTensors(worker_pb2.ListTensorsRequest())
        assert out not in {t.name for t in listed.tensors}
    _alive(pids)
    # The cluster still works; into the operand's own name it fits (6 MiB).
    gathered = client.all_gather(name)
    for rank in range(2):
        torch.testing.assert_close(client.get(name, rank=rank), torch.stack(parts))
    torch.testing.assert_close(torch.stack(list(gathered)), torch.stack(parts))
    _alive(pids)


def test_full_op_queue_answers_resource_exhausted(clean, uname) -> None:
    client, channels = clean
    pids = _pids(channels)
    name = uname("q")
    parts = [torch.randn(1 << 19) for _ in range(2)]  # 2 MiB each
    for rank, part in enumerate(parts):
        client.put(name, part, rank=rank)
    leader = worker_pb2_grpc.WorkerStub(channels[0])
    futures = [
        leader.AllReduce.future(
            worker_pb2.AllReduceRequest(options=worker_pb2.OpOptions(), name=name), timeout=60
        )
        for _ in range(16)
    ]
    done, refused = 0, []
    for f in futures:
        try:
            f.result()
            done += 1
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
            refused.append(err.details())
    assert refused, "16 concurrent ops never filled a queue of 2"
    assert done >= 1
    assert f"queue is full ({QUEUE} ops)" in refused[0]
    # Exactly `done` all-reduces ran: the value is the sum scaled by 2**(done-1).
    expected = torch.stack(parts).sum(0) * 2 ** (done - 1)
    for rank in range(2):
        torch.testing.assert_close(client.get(name, rank=rank), expected, rtol=1e-4, atol=1e-3)
    _alive(pids)


def test_sdk_retries_a_full_queue_within_the_generation_and_every_op_runs_once(
    limited_address, clean, gen, uname, caplog
) -> None:
    """A never-started op (the leader's queue was full) is retried while the
    generation is unchanged, and succeeds; each op ran exactly once (torch's sum).

    The queue is filled deterministically: the follower is stopped (SIGSTOP) so the
    leader's first op blocks; two more fill its queue of 2; the rest are refused with
    QUEUE_FULL and retried by the SDK; the follower resumes well inside its lease. The
    operands (128 KiB) are too large to travel inline, so the leader never fuses queued
    ops into one run (``worker/fusion.py``): whatever order they arrive in, one runs
    and two wait."""
    client, channels = clean
    follower_pid = _pids(channels)[1]
    names = [uname(f"r{i}") for i in range(6)]
    parts = {n: [torch.randn(1 << 15, generator=gen) for _ in range(2)] for n in names}
    for n in names:
        for rank in range(2):
            client.put(n, parts[n][rank], rank=rank)
    generation = client.generation
    leader = worker_pb2_grpc.WorkerStub(channels[0])
    caplog.set_level(logging.INFO, logger="collectives")
    clients = [collectives.connect(limited_address, timeout=CONNECT_TIMEOUT_S) for _ in names]
    stop_process(follower_pid)
    try:
        works = [c.all_reduce(n, async_op=True) for c, n in zip(clients[:3], names, strict=False)]
        wait_until(
            lambda: leader.GetState(worker_pb2.GetStateRequest(), timeout=5).queue_depth == QUEUE,
            5,
            "the leader's queue to fill behind the blocked op",
        )
        works += [
            c.all_reduce(n, async_op=True) for c, n in zip(clients[3:], names[3:], strict=True)
        ]
        wait_until(
            lambda: any("queue is full" in r.getMessage() for r in caplog.records),
            5,
            "the SDK to meet a full queue and retry",
        )
    finally:
        os.kill(follower_pid, signal.SIGCONT)
    try:
        for work in works:
            assert work.wait(60) is None
            assert work.generation == generation
    finally:
        for c in clients:
            c.close()
    for n in names:
        for rank in range(2):
            torch.testing.assert_close(client.get(n, rank=rank), parts[n][0] + parts[n][1])
    assert client.generation == generation  # no membership change: the lease held
