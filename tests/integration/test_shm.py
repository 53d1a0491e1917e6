"""The same-host shared-memory fast path: PutTensorShm / GetTensorShm.

Round trips through ``connect(..., shared_memory=True)`` must be bit-exact for
every dtype and shape (empty and 0-dim included), must really take the fast
path (spied), must leave no segment behind in ``/dev/shm``, and must fall back
to the gRPC stream when the worker is not on this host (simulated by changing
the hostname the SDK compares with). Bad segment handles sent with the raw
stubs are refused with INVALID_ARGUMENT and leave the worker serving.
"""

from __future__ import annotations

import glob
import os
import uuid

import grpc
import pytest
import torch

import collectives
from collectives.ops import data_plane as _data_plane
from collectives.v1 import tensor_pb2, worker_pb2, worker_pb2_grpc
from collectives.wire import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")

TIMEOUT_S = 30.0

CASES = [
    (torch.float32, (1000, 33)),
    (torch.float64, (7,)),
    (torch.float16, (3, 4, 5)),
    (torch.bfloat16, (129,)),
    (torch.int64, (2, 3)),
    (torch.int8, (4096,)),
    (torch.uint8, (3 * 1024 * 1024 + 7,)),  # not a multiple of anything
    (torch.bool, (17,)),
    (torch.complex64, (5, 2)),
    (torch.float32, ()),  # 0-dim
    (torch.float32, (0,)),  # empty
    (torch.int32, (3, 0, 2)),  # empty, several dims
]


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=gen, dtype=dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _our_segments() -> set[str]:
    """The SDK's segments in /dev/shm made by this process or one it started (its
    clusters' workers): the other test processes running beside it make and free
    segments of their own meanwhile (each name carries its maker's pid)."""
    return {
        path
        for path in glob.glob(os.path.join(shm.SHM_DIR, "collectives-*"))
        if _started_here(_maker_pid(path))
    }


def _maker_pid(path: str) -> int:
    try:
        return int(os.path.basename(path).split("-")[2])
    except (IndexError, ValueError):
        return -1


def _started_here(pid: int) -> bool:
    """``pid`` is this process or a descendant of it (False once it has ended)."""
    for _ in range(64):  # bounded: a process tree is never this deep
        if pid == os.getpid():
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


class _Spy:
    """Counts calls of the SDK's transfer functions (the real ones still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        for fn in ("put_tensor", "get_tensor", "put_tensor_shm", "get_tensor_shm"):
            real = getattr(_data_plane, fn)
            monkeypatch.setattr(_data_plane, fn, self._wrap(fn, real))

    def _wrap(self, fn, real):
        def wrapped(*args, **kwargs):
            self.calls[fn] = self.calls.get(fn, 0) + 1
            return real(*args, **kwargs)

        return wrapped


@pytest.fixture(scope="module")
def shm_client(cluster2_address: str):
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as client:
        yield client


IDS = [f"{str(d)[6:]}-{'x'.join(map(str, s)) or 'scalar'}" for d, s in CASES]


@pytest.mark.parametrize("dtype,shape", CASES, ids=IDS)
def test_round_trip_is_bit_exact(shm_client, monkeypatch, gen, uname, dtype, shape):
    spy = _Spy(monkeypatch)
    before = _our_segments()
    t = _random(dtype, shape, gen)
    name = uname("shm")
    shm_client.put(name, t)  # every rank: one segment read by both workers
    for rank in range(shm_client.world_size):
        back = shm_client.get(name, rank=rank)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert _bits(back) == _bits(t)
    assert spy.calls.get("put_tensor_shm") == shm_client.world_size
    assert spy.calls.get("get_tensor_shm") == shm_client.world_size
    assert "put_tensor" not in spy.calls and "get_tensor" not in spy.calls
    # Segments are pooled for reuse by the client, a few at most.
    assert len(_our_segments() - before) <= 2
    shm_client.delete(name)


def test_segments_are_reused_and_unlinked_on_close(cluster2_address, gen):
    before = _our_segments()
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as client:
        for i in range(4):
            t = torch.randn(1000 + i, generator=gen)
            client.put("shm-reuse", t)
            assert torch.equal(client.get("shm-reuse", rank=1), t)
        assert len(_our_segments() - before) <= 2
        client.delete("shm-reuse")
    assert _our_segments() <= before, "a shared-memory segment was left behind"


def test_a_returned_tensor_keeps_its_segment_until_freed(cluster2_address, gen):
    """A get returns a tensor over the segment the worker wrote (no copy). While
    it or any view of it lives, later puts and gets use other segments; once
    freed, its segment is reused."""
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as client:
        first, second = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
        client.put("shm-lend", first, rank=0)
        held = client.get("shm-lend", rank=0)[10:20]  # only a view survives
        for _ in range(3):
            client.put("shm-lend", second, rank=0)
            assert torch.equal(client.get("shm-lend", rank=0), second)
        assert torch.equal(held, first[10:20]), "a lent segment was written while in use"
        segments = _our_segments()
        del held
        for _ in range(3):
            assert torch.equal(client.get("shm-lend", rank=0), second)
        assert _our_segments() <= segments, "freed segments were not reused"
        client.delete("shm-lend")


def test_environment_turns_it_on(cluster2_address, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM", "1")
    spy = _Spy(monkeypatch)
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S) as client:
        client.put("shm-env", torch.arange(5), rank=0)
        assert torch.equal(client.get("shm-env", rank=0), torch.arange(5))
        client.delete("shm-env")
    assert spy.calls.get("put_tensor_shm") == 1 and spy.calls.get("get_tensor_shm") == 1


def test_non_contiguous_and_conjugated_inputs(shm_client, gen, uname):
    t = torch.randn(64, 48, generator=gen).t()[::2]
    name = uname("view")
    shm_client.put(name, t, rank=1)
    assert torch.equal(shm_client.get(name, rank=1), t)
    z = torch.randn(9, dtype=torch.complex64, generator=gen).conj()
    shm_client.put(name, z, rank=0)
    assert torch.equal(shm_client.get(name, rank=0), z.resolve_conj())
    shm_client.delete(name)


def test_missing_tensor_is_not_found(shm_client, uname):
    with pytest.raises(collectives.NotFound):
        shm_client.get(uname("absent"), rank=0)


def test_falls_back_to_the_stream_when_not_on_the_same_host(shm_client, monkeypatch, gen, uname):
    monkeypatch.setattr(_data_plane, "_local_hostname", lambda: "some-other-host.example")
    spy = _Spy(monkeypatch)
    t = torch.randn(1000, generator=gen)
    name = uname("remote")
    shm_client.put(name, t)
    assert torch.equal(shm_client.get(name, rank=1), t)
    assert "put_tensor_shm" not in spy.calls and "get_tensor_shm" not in spy.calls
    assert spy.calls["put_tensor"] == shm_client.world_size and spy.calls["get_tensor"] == 1
    shm_client.delete(name)


def test_off_by_default(cluster2, monkeypatch, gen, uname):
    monkeypatch.delenv("COLLECTIVES_SHM", raising=False)
    spy = _Spy(monkeypatch)
    name = uname("default")
    cluster2.put(name, torch.ones(3), rank=0)
    assert torch.equal(cluster2.get(name, rank=0), torch.ones(3))
    assert "put_tensor_shm" not in spy.calls and "get_tensor_shm" not in spy.calls
    cluster2.delete(name)


# ----------------------------------------------------------- raw stubs: bad handles
@pytest.fixture(scope="module")
def worker_stub(shm_client):
    address = shm_client.workers()[0].address
    with grpc.insecure_channel(address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def _request(path: str, nbytes: int = 16, offset: int = 0) -> worker_pb2.PutTensorShmRequest:
    header = tensor_pb2.TensorHeader(
        name=f"bad-{uuid.uuid4().hex[:6]}",
        dtype=tensor_pb2.DTYPE_FLOAT32,
        shape=[nbytes // 4],
        nbytes=nbytes,
    )
    return worker_pb2.PutTensorShmRequest(header=header, path=path, offset=offset)


@pytest.fixture
def small_segment():
    path = shm.create_segment(torch.zeros(2, dtype=torch.float32))  # 8 bytes
    yield path
    shm.unlink(path)


@pytest.mark.parametrize(
    "path,needle",
    [
        ("", "empty"),
        ("/etc/passwd", "directly under /dev/shm"),
        ("/dev/shm/../etc/passwd", "directly under /dev/shm"),
        ("relative-name", "directly under /dev/shm"),
        ("/dev/shm/collectives-does-not-exist", "cannot open"),
    ],
)
def test_bad_path_is_invalid_argument(worker_stub, shm_client, path, needle):
    with pytest.raises(grpc.RpcError) as info:
        worker_stub.PutTensorShm(_request(path), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()
    # The worker still serves a round trip.
    shm_client.put("shm-after-bad", torch.arange(4), rank=0)
    assert torch.equal(shm_client.get("shm-after-bad", rank=0), torch.arange(4))


def test_too_small_segment_symlink_and_bad_header(worker_stub, small_segment):
    cases = [
        (_request(small_segment, nbytes=16), "offset 0 + 16 bytes needed"),
        (_request(small_segment, nbytes=8, offset=4), "offset 4 + 8 bytes needed"),
        (_request(small_segment, nbytes=4, offset=-1), "negative"),
    ]
    link = os.path.join(shm.SHM_DIR, f"collectives-link-{uuid.uuid4().hex}")
    os.symlink(small_segment, link)
    try:
        cases.append((_request(link, nbytes=8), "cannot open"))
        bad_header = _request(small_segment, nbytes=8)
        bad_header.header.nbytes = 12  # disagrees with shape [2] of float32
        cases.append((bad_header, "needs 8"))
        for request, needle in cases:
            with pytest.raises(grpc.RpcError) as info:
                worker_stub.PutTensorShm(request, timeout=TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert needle in info.value.details()
    finally:
        os.unlink(link)


def test_directory_is_refused(worker_stub):
    path = os.path.join(shm.SHM_DIR, f"collectives-dir-{uuid.uuid4().hex}")
    os.mkdir(path)
    try:
        with pytest.raises(grpc.RpcError) as info:
            worker_stub.PutTensorShm(_request(path), timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        os.rmdir(path)


def test_get_into_a_foreign_file_is_refused(worker_stub, shm_client):
    shm_client.put("shm-foreign", torch.arange(4), rank=0)
    path = os.path.join(shm.SHM_DIR, f"not-ours-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    try:
        with pytest.raises(grpc.RpcError) as info:
            worker_stub.GetTensorShm(
                worker_pb2.GetTensorShmRequest(name="shm-foreign", path=path), timeout=TIMEOUT_S
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "collectives-*" in info.value.details()
        with open(path, "rb") as f:
            assert f.read() == b"\0" * 64, "the worker wrote into a file it must not touch"
    finally:
        os.unlink(path)


def test_get_into_a_too_small_segment_gets_a_new_one(worker_stub, shm_client, small_segment):
    t = torch.arange(100, dtype=torch.int64)  # 800 bytes > the 8-byte segment
    shm_client.put("shm-small", t, rank=0)
    response = worker_stub.GetTensorShm(
        worker_pb2.GetTensorShmRequest(name="shm-small", path=small_segment), timeout=TIMEOUT_S
    )
    try:
        assert response.path != small_segment and shm.is_worker_segment(response.path)
        assert os.path.getsize(response.path) == 800
    finally:
        shm.unlink(response.path)
