"""Model weights as versioned cluster state: publishes under live inference.

Every ``dp(x)`` output must equal, exactly, what the local model computes at the
version the SDK reports, shard by shard (the same split the SDK makes): a
forward whose shards straddled a publish would match neither version.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from helpers import connect_ready

import collectives
from collectives.errors import Reason
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire.pytree import scatter_kwargs
from collectives_server import model_zoo

ZOO = "collectives_server.model_zoo"
KWARGS = {"in_features": 12, "hidden": 24, "out_features": 5, "depth": 2, "seed": 11}
pytestmark = pytest.mark.timeout(240)


def _random_state(like: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in like.items()}


def _expected(weights: dict[str, torch.Tensor], x: torch.Tensor, world: int) -> torch.Tensor:
    """The local model at ``weights`` on each of the SDK's shards of ``x``."""
    local = model_zoo.mlp(**KWARGS)
    local.load_state_dict(weights)
    parts, _ = scatter_kwargs((x,), {}, world)
    with torch.no_grad():
        return torch.cat([local(*p) for p in parts])


def test_publishes_under_live_inference_never_mix_versions(cluster, gen, uname) -> None:
    name = uname("live")
    info = cluster.load_model(name, factory=f"{ZOO}:mlp", kwargs=KWARGS)
    assert info.version == 1
    world = cluster.world_size
    weights = {1: model_zoo.mlp(**KWARGS).state_dict()}
    publishes, clients, calls = 24, 4, 30
    stop = threading.Event()
    seen: list[list[tuple[torch.Tensor, torch.Tensor, int]]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    seeds = [int(s) for s in torch.randint(0, 1 << 30, (clients,), generator=gen)]

    started = threading.Barrier(clients + 1, timeout=120)

    def infer(i: int) -> None:
        try:
            local_gen = torch.Generator().manual_seed(seeds[i])
            with connect_ready(cluster.address, world) as client:
                dp = client.data_parallel(name)

                def call() -> None:
                    batch = int(torch.randint(world, 4 * world, (1,), generator=local_gen))
                    x = torch.randn(batch, KWARGS["in_features"], generator=local_gen)
                    with torch.no_grad():
                        out = dp(x)
                    seen[i].append((x, out, dp.last_version))

                call()  # before any publish: version 1
                started.wait()
                # At least ``calls`` while the publishes run, then one after the last.
                while len(seen[i]) <= calls or not stop.is_set():
                    call()
                    if len(seen[i]) > 100 * calls:
                        raise AssertionError("the publishes never ended")
                call()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            started.abort()

    threads = [threading.Thread(target=infer, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    versions = []
    try:
        started.wait()  # every client is serving: the publishes run under live inference
        for _ in range(publishes):
            state = _random_state(weights[1], gen)
            version = cluster.publish(name, state)
            weights[version] = state
            versions.append(version)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors
    assert versions == sorted(set(versions)) and versions[0] == 2, versions
    assert [m.version for m in cluster.models() if m.name == name] == [versions[-1]]
    for per_client in seen:
        assert len(per_client) >= calls + 2
        assert per_client[0][2] == 1 and per_client[-1][2] == versions[-1]
        observed = [v for _, _, v in per_client]
        assert observed == sorted(observed), "a client saw the version go backwards"
        for x, out, version in per_client:
            assert version in weights, f"output reports unknown version {version}"
            torch.testing.assert_close(out, _expected(weights[version], x, world), rtol=0, atol=0)


def test_partial_and_cast_publishes(cluster2, gen, uname) -> None:
    name = uname("partial")
    cluster2.load_model(name, factory=f"{ZOO}:mlp", kwargs=KWARGS)
    local = model_zoo.mlp(**KWARGS)
    bias = torch.randn(KWARGS["hidden"], generator=gen)
    assert cluster2.publish(name, {"0.bias": bias}, strict=False) == 2
    local.load_state_dict({"0.bias": bias}, strict=False)
    weight = torch.randn(KWARGS["hidden"], KWARGS["in_features"], generator=gen).bfloat16()
    with pytest.raises(collectives.InvalidArgument, match=r"bfloat16.*cast=True"):
        cluster2.publish(name, {"0.weight": weight}, strict=False)
    with pytest.raises(collectives.InvalidArgument, match=r"missing \['0.weight'"):
        cluster2.publish(name, {"0.bias": bias})
    with pytest.raises(collectives.InvalidArgument, match="shape"):
        cluster2.publish(name, {"0.bias": torch.randn(3, generator=gen)}, strict=False)
    assert cluster2.load_state_dict(name, {"0.weight": weight}, strict=False, cast=True) == 3
    local.load_state_dict({"0.weight": weight.float()}, strict=False)
    for rank in range(2):
        state = cluster2.state_dict(name, rank=rank)
        assert all(torch.equal(state[k], v) for k, v in local.state_dict().items())
    x = torch.randn(7, KWARGS["in_features"], generator=gen)
    dp = cluster2.data_parallel(name)
    with torch.no_grad():
        torch.testing.assert_close(dp(x), _expected(local.state_dict(), x, 2), rtol=0, atol=0)
    assert dp.last_version == 3
    assert [m.version for m in cluster2.models() if m.name == name] == [3]


def test_optimizer_steps_count_as_versions_and_keep_their_state(cluster2, gen, uname) -> None:
    """A publish between two Adam steps: the optimizer keeps its moments and steps the
    published weights, exactly as local Adam does after ``load_state_dict``."""
    name = uname("adam")
    cluster2.load_model(name, factory=f"{ZOO}:mlp", kwargs=KWARGS)
    local = model_zoo.mlp(**KWARGS)
    opt = torch.optim.Adam(local.parameters(), lr=0.01)
    x = torch.randn(8, KWARGS["in_features"], generator=gen)
    y = torch.randn(8, KWARGS["out_features"], generator=gen)
    dp = cluster2.data_parallel(name)

    def step() -> None:
        cluster2.zero_grad(name)
        torch.nn.functional.mse_loss(dp(x), y).backward()
        cluster2.all_reduce_gradients(name, op="sum")
        cluster2.step(name, optimizer="adam", lr=0.01)
        opt.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        opt.step()

    step()
    published = _random_state(local.state_dict(), gen)
    assert cluster2.publish(name, published) == 3  # 1, +1 for the step
    with torch.no_grad():
        for k, p in local.state_dict().items():
            p.copy_(published[k])
    step()
    assert [m.version for m in cluster2.models() if m.name == name] == [4]
    state = cluster2.state_dict(name, rank=1)
    for k, v in local.state_dict().items():
        torch.testing.assert_close(state[k], v)


def test_a_publish_for_an_unknown_model_or_empty_state_dict_is_refused(cluster2) -> None:
    with pytest.raises(collectives.NotFound, match="not loaded on any rank"):
        cluster2.publish("no-such-model", {"w": torch.randn(2)})
    with pytest.raises(collectives.InvalidArgument, match="empty"):
        cluster2.publish("no-such-model", {})
    with pytest.raises(collectives.InvalidArgument, match="str keys to tensors"):
        cluster2.publish("no-such-model", {"w": [1.0]})
    with pytest.raises(collectives.InvalidArgument, match="reserved for publish"):
        cluster2.put("__publish/mine/w", torch.randn(2))
    with grpc.insecure_channel(cluster2.leader) as channel:
        listed = worker_pb2_grpc.WorkerStub(channel).ListTensors(
            worker_pb2.ListTensorsRequest(), timeout=10
        )
    assert not [t for t in listed.tensors if t.name.startswith("__publish/")]


def test_a_retained_graph_keeps_its_version_and_bounds_resident_versions(
    cluster2, gen, uname
) -> None:
    """A graph retained at version 1 survives publish 2 (its backward uses the weights
    its forward did); publish 3 would make a third version resident and is refused
    until the graph is gone. MiB-sized weights take the path that receives into the
    previous version's memory."""
    kwargs = {"in_features": 512, "hidden": 512, "out_features": 4, "depth": 2, "seed": 9}
    name = uname("graph")
    cluster2.load_model(name, factory=f"{ZOO}:mlp", kwargs=kwargs)
    dp = cluster2.data_parallel(name)
    first = model_zoo.mlp(**kwargs)
    x = torch.randn(4, 512, generator=gen, requires_grad=True)
    out = dp(x)  # grad enabled: each worker retains its graph at version 1
    assert dp.last_version == 1
    states = [_random_state(first.state_dict(), gen) for _ in range(3)]
    assert cluster2.publish(name, states[0]) == 2
    with pytest.raises(collectives.ResourceExhausted, match="third version") as refused:
        cluster2.publish(name, states[1])
    assert refused.value.reason == Reason.VERSIONS_RESIDENT
    out.sum().backward()
    x_local = x.detach().clone().requires_grad_(True)
    first(x_local).sum().backward()
    torch.testing.assert_close(x.grad, x_local.grad)
    for version, state in enumerate(states[1:], start=3):
        assert cluster2.publish(name, state) == version
        probe = torch.randn(6, 512, generator=gen)
        with torch.no_grad():
            got = dp(probe)
        local = model_zoo.mlp(**kwargs)
        local.load_state_dict(state)
        parts, _ = scatter_kwargs((probe,), {}, 2)
        with torch.no_grad():
            want = torch.cat([local(*p) for p in parts])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert dp.last_version == version
