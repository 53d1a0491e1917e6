"""Models built on the workers by operator-allowed factories, and weights as state dicts."""

from __future__ import annotations

import pytest
import torch

import collectives
from collectives_server import model_zoo

ZOO = "collectives_server.model_zoo"


def test_factory_model_matches_the_same_factory_locally(cluster, gen, uname) -> None:
    kwargs = {"in_features": 5, "hidden": 16, "out_features": 2, "depth": 3, "seed": 7}
    name = uname("zoo")
    info = cluster.load_model(name, factory=f"{ZOO}:mlp", kwargs=kwargs)
    assert info.source == f"{ZOO}:mlp"
    local = model_zoo.mlp(**kwargs)
    assert info.parameters == sum(p.numel() for p in local.parameters())
    for batch in (1, 7, 100):
        x = torch.randn(batch, 5, generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(cluster.data_parallel(name)(x), local(x))


def test_namedtuple_outputs_and_non_tensor_kwargs(cluster3, gen, uname) -> None:
    name = uname("heads")
    cluster3.load_model(name, factory=f"{ZOO}:two_heads", kwargs={"in_features": 4, "seed": 3})
    local = model_zoo.two_heads(4, seed=3)
    x = torch.randn(8, 4, generator=gen)
    with torch.no_grad():
        got = cluster3.data_parallel(name)(x, scale=2.5)  # 2.5 is duplicated to every worker
        want = local(x, scale=2.5)
    assert type(got).__name__ == "Heads" and got._fields == ("scores", "total")
    torch.testing.assert_close(got.scores, want.scores)
    torch.testing.assert_close(got.total, want.total)


def test_factory_outside_the_allowed_modules_is_permission_denied(cluster2, uname) -> None:
    with pytest.raises(collectives.PermissionDenied) as info:
        cluster2.load_model(uname("no"), factory="os:getcwd")
    assert "--allow-factory" in info.value.message


def test_weights_travel_as_a_state_dict(cluster2, gen, uname) -> None:
    kwargs = {"in_features": 3, "hidden": 8, "out_features": 2, "seed": 1}
    trained = model_zoo.mlp(**kwargs)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    name = uname("weights")
    cluster2.load_model(name, factory=f"{ZOO}:mlp", kwargs=kwargs, state_dict=trained.state_dict())
    x = torch.randn(5, 3, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(cluster2.data_parallel(name)(x), trained(x))
    for rank in range(2):
        state = cluster2.state_dict(name, rank=rank)
        assert all(torch.equal(state[k], v) for k, v in trained.state_dict().items())
    with pytest.raises(collectives.InvalidArgument, match="do not match"):
        cluster2.load_state_dict(name, {"not.a.key": torch.randn(2)})
