"""Calls that stall cannot hold a worker.

40 ``PutTensor`` streams that send a header and one chunk and then nothing,
with no deadline: before, they held every thread of the worker's gRPC pool
forever and its health check and ``GetState`` timed out. Now health, state and
a legitimate client's ops go on while they stall, the stalled streams are
cancelled after ``--stream-idle-s``, and calls beyond the per-host cap are
refused at once with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers import wait_until
from hostile import Aftermath, assert_serving, rss_bytes

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire import codec
from collectives.wire.names import MODEL_METADATA_KEY

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(240)

IDLE_S = 2.0
STALLED = 40


def _stalled_put(name: str, stop: threading.Event) -> Iterator[bytes]:
    messages = codec.encode_tensor_stream(name, torch.randn(1 << 18), chunk_bytes=1 << 16)
    yield next(messages)  # the header
    yield next(messages)  # one chunk of sixteen, then nothing
    stop.wait(120)


@contextlib.contextmanager
def _stalled_puts(address: str, count: int) -> Iterator[list[grpc.Future]]:
    stop = threading.Event()
    channel = grpc.insecure_channel(address)
    put = channel.stream_unary(
        "/collectives.v1.Worker/PutTensor",
        request_serializer=None,
        response_deserializer=worker_pb2.PutTensorResponse.FromString,
    )
    calls = [put.future(_stalled_put(f"stall/{i}", stop)) for i in range(count)]  # no deadline
    try:
        yield calls
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        channel.close()


def test_stalled_streams_do_not_freeze_a_worker_and_are_cut(fresh_cluster, gen) -> None:
    _, client = fresh_cluster(2, "--stream-idle-s", str(IDLE_S))
    aftermath = Aftermath(client).capture()
    target = max((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
    started = time.monotonic()
    with _stalled_puts(target.address, STALLED) as calls:
        # While they stall: health, state and real work all answer.
        assert_serving(target.address, within_s=1.0)
        with grpc.insecure_channel(target.address) as channel:
            worker_pb2_grpc.WorkerStub(channel).GetState(worker_pb2.GetStateRequest(), timeout=1.0)
        parts = [torch.randn(33, generator=gen) for _ in range(2)]
        for rank, t in enumerate(parts):
            client.put("stall/x", t, rank=rank)
        client.all_reduce("stall/x", timeout=10)
        torch.testing.assert_close(client.get("stall/x", rank=1), sum(parts))
        # Each stalled stream is cancelled once idle for --stream-idle-s.
        wait_until(lambda: all(c.done() for c in calls), IDLE_S + 10, "the stalled puts to be cut")
        cut_after = time.monotonic() - started
        codes = {c.exception().code() for c in calls if c.exception() is not None}
        assert codes == {grpc.StatusCode.CANCELLED}, codes
        assert cut_after < IDLE_S + 10
    log.info(f"{STALLED} stalled puts cut after {cut_after:.2f} s (--stream-idle-s {IDLE_S:g})")
    for rank in range(2):
        with pytest.raises(collectives.NotFound):
            client.get("stall/0", rank=rank)
    aftermath.check()


def test_calls_beyond_the_per_host_cap_are_refused_at_once(fresh_cluster) -> None:
    _, client = fresh_cluster(2, "--stream-idle-s", "30", "--max-data-streams-per-peer", "8")
    aftermath = Aftermath(client).capture()
    target = max((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
    with _stalled_puts(target.address, 8) as calls:
        with grpc.insecure_channel(target.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)

            def refused() -> bool:
                try:
                    stub.GetTensor(worker_pb2.GetTensorRequest(name="nope"), timeout=2).next()
                except grpc.RpcError as err:
                    return err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (
                        "--max-data-streams-per-peer 8" in (err.details() or "")
                    )
                return False

            # Once the 8 stalled puts hold their slots, a ninth call is refused.
            wait_until(refused, 10, "a call beyond the cap to be refused")
            assert_serving(target.address, within_s=1.0)
        assert not any(c.done() for c in calls)
    # The slots come back when the stalled calls end.
    wait_until(lambda: _get_state_ok(target.address), 10, "the worker to serve again")
    aftermath.check()


def _get_state_ok(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            worker_pb2_grpc.WorkerStub(channel).GetTensor(
                worker_pb2.GetTensorRequest(name="nope"), timeout=2
            ).next()
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.NOT_FOUND
    return False


MiB = 1 << 20


def _partial_put(name: str, declared: int, sent: int, stop: threading.Event) -> Iterator[bytes]:
    """Declares ``declared`` bytes, sends ``sent`` of them (random), then stalls."""
    gen = torch.Generator().manual_seed(len(name))
    messages = codec.encode_tensor_stream(
        name, torch.randint(0, 255, (declared,), dtype=torch.uint8, generator=gen),
        chunk_bytes=4 * MiB,
    )  # fmt: skip
    yield next(messages)
    for _ in range(sent // (4 * MiB)):
        yield next(messages)
    stop.wait(120)


def test_cancelled_or_truncated_puts_give_their_memory_back_at_once(fresh_cluster) -> None:
    """Each put declares 160 MiB and sends 120. Four are cancelled by the client, four end
    their stream early: the worker frees every partial buffer at once, not at a later GC.

    A cancel can reach the handler as a cancellation or as the end of the stream (the
    client's half-close racing its cancel); the second fails in ``TensorAssembler.finish``,
    whose frame held the buffer through the exception gRPC keeps.
    """
    _, client = fresh_cluster(2, "--stream-idle-s", "60")
    aftermath = Aftermath(client).capture()
    target = _target_of(client)
    base = rss_bytes(target.pid)
    with grpc.insecure_channel(target.address) as channel:
        put = channel.stream_unary(
            "/collectives.v1.Worker/PutTensor",
            request_serializer=None,
            response_deserializer=worker_pb2.PutTensorResponse.FromString,
        )
        for i in range(4):
            stop = threading.Event()
            call = put.future(_partial_put(f"cancelled/{i}", 160 * MiB, 120 * MiB, stop))
            wait_until(lambda: rss_bytes(target.pid) > base + 100 * MiB, 30, "120 MiB to arrive")
            call.cancel()
            stop.set()
            _wait_freed(target.pid, base, f"cancelled put {i}")
        for i in range(4):
            ended = threading.Event()
            ended.set()
            call = put.future(_partial_put(f"truncated/{i}", 160 * MiB, 120 * MiB, ended))
            with pytest.raises(grpc.RpcError) as refused:
                call.result(timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"stream ended after {120 * MiB} of {160 * MiB}" in refused.value.details()
            _wait_freed(target.pid, base, f"truncated put {i}")
    aftermath.check()


def _wait_freed(pid: int, base: int, what: str) -> None:
    started = time.monotonic()
    wait_until(lambda: rss_bytes(pid) < base + 64 * MiB, 10, f"{what}'s partial buffer freed")
    log.info(f"{what}: RSS back within {time.monotonic() - started:.2f} s")


def test_concurrent_puts_are_counted_against_the_quota_at_their_header(fresh_cluster) -> None:
    _, client = fresh_cluster(2, "--max-tensor-bytes", "256MiB", "--stream-idle-s", "60")
    aftermath = Aftermath(client).capture()
    target = _target_of(client)
    base = rss_bytes(target.pid)
    stop = threading.Event()
    with grpc.insecure_channel(target.address) as channel:
        put = channel.stream_unary(
            "/collectives.v1.Worker/PutTensor",
            request_serializer=None,
            response_deserializer=worker_pb2.PutTensorResponse.FromString,
        )
        calls = [
            put.future(_partial_put(f"concurrent/{i}", 200 * MiB, 8 * MiB, stop)) for i in range(4)
        ]
        try:
            wait_until(lambda: sum(c.done() for c in calls) >= 3, 30, "3 puts refused")
            refused = [c for c in calls if c.done()]
            assert len(refused) == 3
            for c in refused:
                assert c.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "its limit is 268435456" in c.exception().details()
            assert rss_bytes(target.pid) < base + 260 * MiB
        finally:
            stop.set()
            for c in calls:
                c.cancel()
    aftermath.check()


def test_failed_streams_leave_nothing_behind(fresh_cluster, gen) -> None:
    """Puts cut short and state dicts refused, many in a row: the worker's memory stays
    flat. A failed stream's handler frame stays in the traceback gRPC keeps, in a
    cycle only a full GC reaches: it held the last chunk of a put (4 MiB) and every
    tensor of a refused state dict until then, so memory grew with each failure."""
    _, client = fresh_cluster(2, "--allow-factory", "collectives_server.model_zoo")
    client.load_model(
        "m",
        factory="collectives_server.model_zoo:mlp",
        kwargs={"in_features": 4, "hidden": 8, "out_features": 2},
    )
    target = _target_of(client)
    refused_state = torch.randn(8 * MiB, generator=gen)  # 32 MiB under a key the model lacks
    with grpc.insecure_channel(target.address) as channel:
        put = channel.stream_unary(
            "/collectives.v1.Worker/PutTensor",
            request_serializer=None,
            response_deserializer=worker_pb2.PutTensorResponse.FromString,
        )
        load_state = channel.stream_unary(
            "/collectives.v1.Worker/LoadStateDict",
            request_serializer=None,
            response_deserializer=worker_pb2.LoadStateDictResponse.FromString,
        )

        def fail_both(i: int) -> None:
            ended = threading.Event()
            ended.set()
            with pytest.raises(grpc.RpcError) as cut:
                put(_partial_put(f"cut/{i}", 48 * MiB, 32 * MiB, ended), timeout=30)
            assert cut.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as refused:
                load_state(
                    codec.encode_tensor_stream("bogus", refused_state),
                    metadata=[(MODEL_METADATA_KEY, "m")],
                    timeout=30,
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unexpected ['bogus']" in refused.value.details()

        for i in range(4):  # the allocator's caches fill up first
            fail_both(i)
        settled = rss_bytes(target.pid)
        peak = settled
        for i in range(4, 28):
            fail_both(i)
            peak = max(peak, rss_bytes(target.pid))
    log.info(f"RSS over 24 rounds of failures: {(peak - settled) / MiB:.0f} MiB above settled")
    assert peak - settled < 48 * MiB, f"grew {(peak - settled) / MiB:.0f} MiB over 24 failures"


def _target_of(client):
    return max((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
