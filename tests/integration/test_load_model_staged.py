"""``load_model`` sends a large archive once: staged on every rank, then loaded from there.

An archive of at least 4 MiB on two or more ranks is replicated once as a uint8
tensor under ``__archive/<id>`` and each worker's LoadModel names it
(``ModelSpec.archive_tensor``): the model computes what local torch computes on
every rank, the client's TCP egress is the archive's bytes once, and no staged
bytes remain anywhere afterwards. A LoadModel naming a staged tensor that is not
a 1-D uint8 of the declared size under the prefix, or is absent, is refused and
the worker keeps serving.
"""

from __future__ import annotations

import logging

import grpc
import pytest
import torch
from helpers import connect_ready
from hostile import assert_serving
from torch import nn

import collectives
import collectives.models.archive_staging as staging
from collectives.models.programs import export_archive
from collectives.transport.endpoints import put_tensor
from collectives.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

MiB = 1 << 20
pytestmark = pytest.mark.timeout(300)
RPC_TIMEOUT_S = 60.0


def _big_mlp(gen: torch.Generator) -> nn.Module:
    """Three 1024x1024 layers: a ~12 MiB archive, over the 4 MiB threshold."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    return nn.Sequential(
        nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.Tanh(),
        nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.Linear(1024, 8),
    ).eval()  # fmt: skip


@pytest.fixture
def staged_calls(monkeypatch) -> list[str]:
    """The staging names replicated (the path is spied on, not changed)."""
    calls: list[str] = []
    real = staging.replicate

    def spy(cluster, name, t, deadline, bar):
        calls.append(name)
        return real(cluster, name, t, deadline, bar)

    monkeypatch.setattr(staging, "replicate", spy)
    return calls


def _held(address: str) -> tuple[list[str], int]:
    """(names under __archive/, bytes_held) on one worker."""
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        listed = stub.ListTensors(worker_pb2.ListTensorsRequest(), timeout=30)
        state = stub.GetState(worker_pb2.GetStateRequest(), timeout=30)
    names = [t.name for t in listed.tensors if t.name.startswith("__archive/")]
    return names, state.bytes_held


def _addresses(cluster) -> list[str]:
    return [w.address for w in sorted(cluster.workers(), key=lambda w: w.rank) if w.rank >= 0]


def test_a_large_archive_is_staged_once_and_computes_like_local(
    cluster, gen, uname, staged_calls
) -> None:
    model = _big_mlp(gen)
    example = (torch.randn(4, 64, generator=gen),)
    archive_bytes = len(export_archive(model, example))
    assert archive_bytes >= staging.REPLICATE_MIN_BYTES
    name = uname("staged")
    addresses = _addresses(cluster)
    held_before = [_held(a)[1] for a in addresses]

    cluster.load_model(name, model, example_inputs=example)  # warm: channels, bulk ports
    assert len(staged_calls) == 1
    from bench import egress

    sent = None
    if egress.available():
        counter = egress.TcpEgress()
        counter.start()
        cluster.load_model(name, model, example_inputs=example)
        sent = counter.stop()
        assert len(staged_calls) == 2
        if not sent.closed:
            ratio = sent.nbytes / archive_bytes
            log.info(f"load_model egress at world {cluster.world_size}: {ratio:.4f}x the archive")
            assert sent.nbytes <= 1.05 * archive_bytes, f"sent {ratio:.3f}x the archive"

    # Every rank holds the very weights, and computes what local torch does.
    local = model.state_dict()
    for rank in range(cluster.world_size):
        remote = cluster.state_dict(name, rank=rank)
        assert remote.keys() == local.keys()
        for key, value in local.items():
            assert torch.equal(remote[key], value), f"rank {rank}: {key}"
    dp = cluster.data_parallel(name)
    x = torch.randn(3 * cluster.world_size + 1, 64, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(dp(x), model(x))

    # No staged archive left anywhere; the store holds what it held before.
    for address, before in zip(addresses, held_before, strict=True):
        names, held = _held(address)
        assert names == [], f"{address} still holds {names}"
        assert held == before, f"{address}: {held} bytes held, {before} before the load"
    cluster.unload_model(name)


def test_a_small_archive_is_streamed(cluster2, gen, uname, staged_calls) -> None:
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).eval()
    name = uname("small")
    cluster2.load_model(name, model, example_inputs=(torch.randn(4, 6, generator=gen),))
    assert staged_calls == []
    x = torch.randn(5, 6, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(cluster2.data_parallel(name)(x), model(x))
    cluster2.unload_model(name)


def test_one_worker_streams(local_cluster, gen, uname, staged_calls) -> None:
    address = local_cluster(1)
    with connect_ready(address, 1) as client:
        model = _big_mlp(gen)
        client.load_model(uname("one"), model, example_inputs=(torch.randn(2, 64),))
    assert staged_calls == []


def test_user_puts_under_the_archive_prefix_are_refused(cluster2) -> None:
    with pytest.raises(collectives.InvalidArgument, match="reserved for load_model"):
        cluster2.put("__archive/mine", torch.zeros(3, dtype=torch.uint8))


def _load_staged_raw(address: str, spec: worker_pb2.ModelSpec, chunk: bytes = b""):
    def messages():
        yield worker_pb2.LoadModelRequest(spec=spec)
        if chunk:
            yield worker_pb2.LoadModelRequest(archive_chunk=chunk)

    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).LoadModel(messages(), timeout=RPC_TIMEOUT_S)


def _stage_raw(cluster, rank: int, name: str, t: torch.Tensor) -> None:
    """PutTensor straight to one worker (the SDK's put refuses the prefix)."""
    address = _addresses(cluster)[rank]
    put_tensor(cluster._session.endpoint(address), name, t, RPC_TIMEOUT_S)


def _archive_tensor(archive: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(archive), dtype=torch.uint8)


@pytest.fixture(scope="module")
def small_archive() -> bytes:
    model = nn.Sequential(nn.Linear(6, 4)).eval()
    return export_archive(model, (torch.randn(2, 6),))


@pytest.mark.parametrize(
    "case",
    ["float32", "two_dims", "too_short", "too_long", "not_under_prefix", "absent", "and_chunks"],
)
def test_a_bad_staged_tensor_is_refused_and_the_worker_serves(
    cluster2, uname, small_archive, case
) -> None:
    address = _addresses(cluster2)[0]
    good = _archive_tensor(small_archive)
    n = len(small_archive)
    staged = f"__archive/{uname(case).replace('/', '-')}"
    code = grpc.StatusCode.INVALID_ARGUMENT
    chunk = b""
    if case == "float32":
        _stage_raw(cluster2, 0, staged, torch.zeros(n // 4, dtype=torch.float32))
        n = (n // 4) * 4
    elif case == "two_dims":
        _stage_raw(cluster2, 0, staged, good[: (n // 2) * 2].reshape(2, n // 2).clone())
        n = (n // 2) * 2
    elif case == "too_short":
        _stage_raw(cluster2, 0, staged, good[:-1].clone())
    elif case == "too_long":
        _stage_raw(cluster2, 0, staged, torch.cat([good, good[:1]]))
    elif case == "not_under_prefix":
        staged = uname("plain")
        _stage_raw(cluster2, 0, staged, good.clone())
    elif case == "absent":
        code = grpc.StatusCode.NOT_FOUND
    elif case == "and_chunks":
        _stage_raw(cluster2, 0, staged, good.clone())
        chunk = small_archive[:16]
    spec = worker_pb2.ModelSpec(name=uname("m"), archive_nbytes=n, archive_tensor=staged)
    with pytest.raises(grpc.RpcError) as caught:
        _load_staged_raw(address, spec, chunk)
    assert caught.value.code() == code, caught.value.details()
    assert_serving(address)
    # The worker still loads a good staged archive, and deletes it once read.
    ok = f"__archive/{uname('ok').replace('/', '-')}"
    _stage_raw(cluster2, 0, ok, good.clone())
    model = uname("ok")
    spec = worker_pb2.ModelSpec(name=model, archive_nbytes=len(small_archive), archive_tensor=ok)
    assert _load_staged_raw(address, spec).model.source == "export"
    assert ok not in _held(address)[0]
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        stub.DeleteTensor(worker_pb2.DeleteTensorRequest(name=staged, missing_ok=True), timeout=30)
        stub.UnloadModel(worker_pb2.UnloadModelRequest(name=model), timeout=30)
