"""``put(name, t)`` on every rank sends each byte once (the replicated put).

A tensor of at least ``REPLICATE_MIN_BYTES`` goes once to the leader, and the
workers broadcast it among themselves in one sequenced op: every rank ends with
the input bit for bit; the client's TCP egress is the tensor's bytes once; a rank
over its quota fails the whole put (RESOURCE_EXHAUSTED) and every rank keeps its
old value; the upload never outlives the put; a put that straddles a generation
change lands on the new generation's ranks.
"""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest
import torch
from helpers import CONNECT_TIMEOUT_S, LEASE_S, connect_ready, make_input, wait_until
from launcher import stop_process

import collectives
import collectives.ops.data_plane as data_plane
from collectives.v1 import worker_pb2, worker_pb2_grpc

MiB = 1 << 20
pytestmark = pytest.mark.timeout(240)

LARGE = [  # every one at least REPLICATE_MIN_BYTES; the first crosses a 25 MiB bucket
    (torch.float32, (30 * MiB // 4,)),
    (torch.bfloat16, (3, 1024, 1024)),
    (torch.int64, (MiB // 2, 1)),
    (torch.complex64, (1024, 600)),
    (torch.bool, (5 * MiB,)),
]
SMALL = [(torch.float16, (3, 4)), (torch.int32, ()), (torch.uint8, (0, 7)), (torch.float64, (9,))]


@pytest.fixture
def replicated(monkeypatch) -> list[str]:
    """The names every replicated put was called for (the path is spied on, not changed)."""
    calls: list[str] = []
    real = data_plane.replicate

    def spy(cluster, name, t, deadline, bar):
        calls.append(name)
        return real(cluster, name, t, deadline, bar)

    monkeypatch.setattr(data_plane, "replicate", spy)
    return calls


def _uploads_left(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        listed = worker_pb2_grpc.WorkerStub(channel).ListTensors(
            worker_pb2.ListTensorsRequest(), timeout=30
        )
    return [t.name for t in listed.tensors if t.name.startswith("__publish/")]


def _check_everywhere(cluster, name: str, want: torch.Tensor) -> None:
    for rank in range(cluster.world_size):
        got = cluster.get(name, rank=rank)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"rank {rank}"
        assert torch.equal(got, want), f"rank {rank}"


def test_large_tensors_of_every_kind_arrive_bit_for_bit(cluster, gen, uname, replicated) -> None:
    name = uname("big")
    for dtype, shape in LARGE:
        t = make_input(dtype, shape, gen)
        cluster.put(name, t)
        _check_everywhere(cluster, name, t)
    assert replicated == [name] * len(LARGE)
    assert _uploads_left(cluster.leader) == []
    cluster.delete(name)


def test_small_tensors_take_the_replicated_op_when_asked(
    cluster, gen, uname, replicated, monkeypatch
) -> None:
    """The op itself for tiny, 0-dim and empty tensors (put sends these in parallel)."""
    monkeypatch.setattr(data_plane, "REPLICATE_MIN_BYTES", 0)
    name = uname("small")
    for dtype, shape in SMALL:
        t = make_input(dtype, shape, gen)
        cluster.put(name, t)
        _check_everywhere(cluster, name, t)
    assert replicated == [name] * len(SMALL)
    cluster.delete(name)


def test_below_the_threshold_put_uploads_to_every_rank(cluster2, gen, uname, replicated) -> None:
    name = uname("tiny")
    t = make_input(torch.float32, (data_plane.REPLICATE_MIN_BYTES // 4 - 1,), gen)
    cluster2.put(name, t)
    _check_everywhere(cluster2, name, t)
    cluster2.put(name, t, rank=1)  # one rank: never replicated
    assert replicated == []
    cluster2.delete(name)


def test_a_large_put_sends_its_bytes_once(cluster3, gen, uname) -> None:
    from bench import egress

    if not egress.available():
        pytest.skip("needs ss and /proc/self/fd to count this process's TCP bytes")
    name = uname("egress")
    t = make_input(torch.float32, (64 * MiB // 4,), gen)
    nbytes = t.numel() * t.element_size()
    cluster3.put(name, t)  # warm: channels and bulk connections open
    counter = egress.TcpEgress()
    counter.start()
    cluster3.put(name, t)
    sent = counter.stop()
    if sent.closed:
        pytest.skip(f"{sent.closed} socket(s) closed during the put: the count is a lower bound")
    assert nbytes <= sent.nbytes <= 1.02 * nbytes, f"sent {sent.nbytes / nbytes:.3f}x the bytes"
    cluster3.delete(name)


def _bytes_held(addresses: list[str]) -> list[int]:
    held = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            state = worker_pb2_grpc.WorkerStub(channel).GetState(
                worker_pb2.GetStateRequest(), timeout=30
            )
        held.append(state.bytes_held)
    return held


def test_one_rank_over_quota_fails_the_whole_put(local_cluster, gen, uname) -> None:
    address = local_cluster(3, "--max-tensor-bytes", "12MiB")
    with connect_ready(address, 3) as client:
        members = sorted((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
        addresses = [w.address for w in members]
        name, filler = uname("x"), uname("filler")
        old = make_input(torch.float32, (MiB,), gen)  # 4 MiB
        client.put(name, old)
        client.put(filler, torch.zeros(3 * MiB // 2), rank=2)  # 6 MiB beside it on rank 2
        with pytest.raises(collectives.ResourceExhausted) as info:
            client.put(name, make_input(torch.float32, (2 * MiB,), gen))  # 8 MiB: 14 > 12
        assert "failed on rank(s) 2" in info.value.message
        assert "limit is 12582912" in info.value.message
        _check_everywhere(client, name, old)
        assert _bytes_held(addresses) == [4 * MiB, 4 * MiB, 10 * MiB]
        assert _uploads_left(client.leader) == []
        # A value that fits only in place of the old one (the leader refuses the
        # upload beside it) still goes through: every rank in parallel.
        client.delete(filler)
        grown = make_input(torch.float32, (5 * MiB // 2,), gen)  # 10 MiB: 4 + 10 > 12
        client.put(name, grown)
        _check_everywhere(client, name, grown)
        assert _bytes_held(addresses) == [10 * MiB] * 3
        assert _uploads_left(client.leader) == []


@pytest.mark.slow
def test_a_put_across_a_generation_change_lands_on_the_new_ranks(fresh_cluster, gen) -> None:
    """The follower the op waits on dies: the attempt fails (not run to a commit), and
    the SDK uploads again to the leader of the survivors' generation."""
    local, client = fresh_cluster(3, "--min-workers", "2")
    members = sorted((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
    generation = client.generation
    victim = members[2].pid
    assert local.owns(victim), f"pid {victim} is not one of this cluster's processes"
    t = make_input(torch.float32, (2 * MiB,), gen)  # 8 MiB
    failures: list[BaseException] = []

    def put() -> None:
        try:
            client.put("x", t, timeout=LEASE_S + 60)
        except BaseException as exc:  # reported below
            failures.append(exc)

    stop_process(victim)
    thread = threading.Thread(target=put)
    try:
        thread.start()
        wait_until(
            lambda: any(w.state == "busy" for w in client.workers() if w.rank == 0),
            CONNECT_TIMEOUT_S,
            "the leader running the put",
        )
    finally:
        os.kill(victim, signal.SIGKILL)
    thread.join(timeout=LEASE_S + 90)
    assert not thread.is_alive() and not failures, failures
    assert client.generation > generation and client.world_size == 2
    _check_everywhere(client, "x", t)
    assert _uploads_left(client.leader) == []
