"""Handing a put's segment over to the worker, and taking it back (no daemon).

The client's side (``SegmentPool.hand_over`` / ``take_back``): a segment handed
over is never leased, written or truncated again until the worker gives it
back, at most ``MAX_HANDED_OVER`` are out per worker, and closing unlinks them.
The worker's side (``AdoptedSegments`` and ``put_tensor_shm``): a same-user
segment is adopted with exact bytes and held while any view lives; a segment
of another user is copied, never mapped, so truncating it cannot crash the
worker; a get never writes into a segment that holds a stored tensor.
"""

from __future__ import annotations

import gc
import os
import types

import pytest
import torch

from collectives.errors import PermissionDenied
from collectives.transport import shm
from collectives.v1 import worker_pb2
from collectives.wire import codec
from collectives.wire import shm as wire_shm
from collectives_server.worker.data import shm_adopt
from collectives_server.worker.data.shm_adopt import AdoptedSegments
from collectives_server.worker.data.shm_segments import WorkerSegments
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.rpc import shm_service

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")

MiB = 1 << 20
WORKER = "127.0.0.1:5000"


@pytest.fixture
def pool():
    p = shm.SegmentPool()
    yield p
    p.close()


def _filled(pool: shm.SegmentPool, t: torch.Tensor) -> shm.Segment:
    segment = pool.acquire(t.numel() * t.element_size())
    assert segment is not None
    segment.write(t)
    return segment


# ------------------------------------------------------------------ client side
def test_a_handed_over_segment_leaves_the_pool_until_taken_back(pool, gen) -> None:
    t = torch.randint(0, 255, (2 * MiB,), dtype=torch.uint8, generator=gen)
    segment = _filled(pool, t)
    assert pool.hand_over(segment, WORKER, 2 * MiB)
    pool.release(segment)  # the put's own release: a no-op while the worker holds it
    other = pool.acquire(2 * MiB)
    assert other is not None and other is not segment, "a held segment was leased again"
    other.write(torch.zeros(2 * MiB, dtype=torch.uint8))
    assert torch.equal(segment.read(0, codec.check_header(codec.make_header("x", t))), t)
    assert pool.handed_over(WORKER) == [segment.path]
    assert pool.handed_over(WORKER, but=segment.path) == []
    pool.release(other)
    pool.take_back(WORKER, [segment.path, "/dev/shm/collectives-seg-unknown"])
    assert segment.holder is None and pool.handed_over(WORKER) == []
    assert pool.acquire(None) is not None  # both free again


def test_hand_over_limits(pool) -> None:
    small = pool.acquire(64 * 1024)
    assert small is not None
    assert not pool.hand_over(small, WORKER, 64 * 1024), "small tensors are copied"
    big = pool.acquire(8 * MiB)
    assert big is not None
    assert not pool.hand_over(big, WORKER, 2 * MiB), "a segment 4x the tensor is not kept"
    segments = [pool.acquire(2 * MiB) for _ in range(shm.MAX_HANDED_OVER + 1)]
    taken = [pool.hand_over(s, WORKER, 2 * MiB) for s in segments if s is not None]
    assert taken == [True] * shm.MAX_HANDED_OVER + [False]
    assert pool.hand_over(segments[0], WORKER, 2 * MiB), "a retry hands over the same again"
    assert not pool.hand_over(segments[0], "127.0.0.1:6000", 2 * MiB), "one worker at a time"
    assert pool.hand_over(segments[-1], "127.0.0.1:6000", 2 * MiB), "the limit is per worker"


def test_current_segment_taken_back_is_released_by_its_caller_only(pool) -> None:
    segment = pool.acquire(2 * MiB)
    assert segment is not None and pool.hand_over(segment, WORKER, 2 * MiB)
    pool.take_back(WORKER, [segment.path], current=segment)
    assert pool.acquire(None) is None, "the caller's lease went back to the pool twice"
    pool.release(segment)
    assert pool.acquire(None) is segment


def test_close_unlinks_segments_handed_over() -> None:
    pool = shm.SegmentPool()
    segment = pool.acquire(2 * MiB)
    assert segment is not None and pool.hand_over(segment, WORKER, 2 * MiB)
    pool.close()
    assert not os.path.exists(segment.path)


# ------------------------------------------------------------------ worker side
def test_adopted_bytes_are_exact_and_held_while_any_view_lives(pool, gen) -> None:
    adopted = AdoptedSegments()
    t = torch.randn(MiB, generator=gen)  # 4 MiB of fresh random data
    segment = _filled(pool, t)
    meta = codec.check_header(codec.make_header("x", t))
    fd = wire_shm.open_checked(segment.path, 0, meta.nbytes, write=True)
    try:
        stored = adopted.adopt(fd, segment.path, 0, meta)
        assert adopted.holds_inode(fd)
    finally:
        os.close(fd)
    assert torch.equal(stored, t)
    view = stored[10:20]
    assert adopted.returned([segment.path]) == []
    del stored
    gc.collect()
    assert adopted.returned([segment.path]) == [], "released while a view lives"
    del view
    gc.collect()
    assert adopted.returned([segment.path]) == [segment.path]
    assert adopted.counts == (0, 1)  # the mapping stays cached for the next hand-over
    pool.release(segment)
    pool.close()  # the client unlinks its segment: the idle mapping is reaped
    assert adopted.reap() == 1 and adopted.counts == (0, 0)


def test_eligibility() -> None:
    adopted = AdoptedSegments()
    me = os.geteuid()
    assert adopted.eligible(me, 4 * MiB, 4 * MiB, 0)
    assert not adopted.eligible(me + 1, 4 * MiB, 4 * MiB, 0), "another user: copy"
    assert not adopted.eligible(me, 4096, 4096, 0), "small: copy"
    assert not adopted.eligible(me, 4 * MiB, 64 * MiB, 0), "pins a much larger file: copy"
    assert not adopted.eligible(me, 4 * MiB, 4 * MiB - 1, 0)


def _ctx(store: TensorStore, segments: WorkerSegments) -> types.SimpleNamespace:
    stats = types.SimpleNamespace(add_bytes=lambda **_: None)
    return types.SimpleNamespace(port=1, store=store, shm_segments=segments, stats=stats)


def _put_request(name: str, t: torch.Tensor, path: str, lent=()):
    return worker_pb2.PutTensorShmRequest(
        header=codec.make_header(name, t), path=path, hand_over=True, lent=list(lent)
    )


def test_put_adopts_for_the_workers_own_user_and_gets_never_write_there(
    pool, gen, monkeypatch
) -> None:
    monkeypatch.setattr(shm_service, "loopback_peer_uid", lambda peer, port: os.geteuid())
    store, segments = TensorStore(torch.device("cpu")), WorkerSegments()
    ctx = _ctx(store, segments)
    first, second = torch.randn(MiB, generator=gen), torch.randn(MiB, generator=gen)
    s1, s2 = _filled(pool, first), _filled(pool, second)
    reply = shm_service.put_tensor_shm(ctx, _put_request("x", first, s1.path), "ipv4:x:1")
    assert reply.adopted and list(reply.returned) == []
    # A get naming the held segment as its target gets a segment of its own.
    got = shm_service.get_tensor_shm(
        ctx, worker_pb2.GetTensorShmRequest(name="x", path=s1.path), "ipv4:x:1"
    )
    assert got.path != s1.path
    wire_shm.unlink(got.path)
    # Replacing the tensor frees the first segment: the next put's answer returns it.
    reply = shm_service.put_tensor_shm(
        ctx, _put_request("x", second, s2.path, lent=[s1.path]), "ipv4:x:1"
    )
    assert reply.adopted and list(reply.returned) == [s1.path]
    assert torch.equal(store.get("x"), second)
    store.delete("x")
    segments.close()


def test_another_users_segment_is_copied_so_truncating_it_is_harmless(
    pool, gen, monkeypatch
) -> None:
    """As a root worker serving another user: the client's uid is not the worker's."""
    me = os.geteuid()
    monkeypatch.setattr(shm_service, "loopback_peer_uid", lambda peer, port: me)
    monkeypatch.setattr(shm_service.os, "geteuid", lambda: me + 1)
    store, segments = TensorStore(torch.device("cpu")), WorkerSegments()
    t = torch.randn(MiB, generator=gen)
    segment = _filled(pool, t)
    reply = shm_service.put_tensor_shm(
        _ctx(store, segments), _put_request("y", t, segment.path, lent=["a"]), "ipv4:x:1"
    )
    assert not reply.adopted and list(reply.returned) == ["a"]
    assert segments.adopted.counts == (0, 0), "another user's file was mapped"
    os.ftruncate(segment.fd, 0)  # a mapping would now SIGBUS: a copy does not care
    assert torch.equal(store.get("y"), t)
    store.delete("y")


def test_a_file_of_another_owner_is_still_refused(pool, gen, monkeypatch) -> None:
    monkeypatch.setattr(shm_service, "loopback_peer_uid", lambda peer, port: os.geteuid() + 1)
    t = torch.randn(MiB, generator=gen)
    segment = _filled(pool, t)
    ctx = _ctx(TensorStore(torch.device("cpu")), WorkerSegments())
    with pytest.raises(PermissionDenied):
        shm_service.put_tensor_shm(ctx, _put_request("z", t, segment.path), "ipv4:x:1")
    assert ctx.shm_segments.adopted.counts == (0, 0)


def test_module_constants_agree() -> None:
    assert shm.HAND_OVER_MIN_BYTES >= shm_adopt.MIN_ADOPT_BYTES


def test_a_worker_segment_whose_name_is_gone_is_used_once(monkeypatch) -> None:
    path = wire_shm.create_segment(torch.arange(4, dtype=torch.int32), kind="get")

    def gone(src, dst):
        raise FileNotFoundError(src)

    monkeypatch.setattr(wire_shm.os, "rename", gone)
    segment = shm.Segment.adopt(path)
    monkeypatch.undo()
    assert segment is not None and not segment.named
    pool = shm.SegmentPool()
    pool.release(segment)  # dropped, not pooled, and the path is not ours to unlink
    assert pool.acquire(None) is None and os.path.exists(path)
    wire_shm.unlink(path)
    pool.close()


@pytest.mark.parametrize("same_user", [True, False])
def test_a_get_into_the_clients_segment_is_exact(pool, gen, monkeypatch, same_user) -> None:
    """The worker's own user: written through a cached mapping; another user: pwrite."""
    me = os.geteuid()
    monkeypatch.setattr(shm_service, "loopback_peer_uid", lambda peer, port: me)
    if not same_user:
        monkeypatch.setattr(shm_service.os, "geteuid", lambda: me + 1)
    store, segments = TensorStore(torch.device("cpu")), WorkerSegments()
    t = torch.randn(MiB, generator=gen)
    store.put("g", t)
    lease = pool.acquire(t.numel() * t.element_size())
    assert lease is not None
    lease.write(torch.zeros_like(t))
    got = shm_service.get_tensor_shm(
        _ctx(store, segments), worker_pb2.GetTensorShmRequest(name="g", path=lease.path), "x"
    )
    assert got.path == lease.path
    assert torch.equal(lease.read(0, codec.check_header(got.header)), t)
    assert segments.adopted.counts == (0, 1 if same_user else 0)
    segments.close()
