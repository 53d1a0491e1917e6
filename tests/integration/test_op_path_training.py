"""Gradients in the workers' gradient arena (DDP's gradient-as-bucket-view).

Backward accumulates into flat per-model buffers and all_reduce_gradients
reduces buckets of them in place. What a user sees must not change: a parameter
that backward did not reach has no gradient (not a zero one: an optimizer with
weight decay would move it), gradients accumulate across backward calls until
zero_grad, and a bucket whose parameters are not consecutive in the arena (a
parameter without a gradient between them) still reduces exactly. Everything
is compared with the same steps taken locally.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

RTOL, ATOL = 1e-4, 1e-6


class WithUnused(nn.Module):
    """``unused`` sits between two used layers, so the used parameters are not
    consecutive in the arena."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.unused = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _model(gen: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return WithUnused()


def _check_grads(cluster, name: str, local: nn.Module) -> None:
    want = {n: p.grad for n, p in local.named_parameters() if p.grad is not None}
    first = None
    for rank in range(cluster.world_size):
        grads = cluster.gradients(name, rank=rank)
        assert set(grads) == set(want), (rank, sorted(grads))
        for n, g in want.items():
            torch.testing.assert_close(grads[n], g, rtol=RTOL, atol=ATOL)
        if first is None:
            first = grads
        else:
            assert all(torch.equal(grads[k], first[k]) for k in first)


def test_unreached_parameters_keep_no_gradient_and_weight_decay_leaves_them(
    cluster3, gen, uname
) -> None:
    model = _model(gen)
    local = copy.deepcopy(model)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1, weight_decay=0.5)
    name = uname("unused")
    cluster3.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    dp = cluster3.data_parallel(name)
    x, y = torch.randn(12, 6, generator=gen), torch.randn(12, 3, generator=gen)
    for _ in range(3):
        cluster3.zero_grad(name)
        F.mse_loss(dp(x), y).backward()
        assert "unused.weight" not in cluster3.gradients(name, rank=0)
        cluster3.all_reduce_gradients(name, op="sum")
        local_opt.zero_grad()
        F.mse_loss(local(x), y).backward()
        _check_grads(cluster3, name, local)
        cluster3.step(name, optimizer="sgd", lr=0.1, weight_decay=0.5)
        local_opt.step()
    for rank in range(3):
        state = cluster3.state_dict(name, rank=rank)
        for key, value in local.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)
        assert torch.equal(state["unused.weight"], model.state_dict()["unused.weight"])


def test_gradients_accumulate_across_backwards_until_zero_grad(cluster2, gen, uname) -> None:
    model = _model(gen)
    local = copy.deepcopy(model)
    name = uname("accumulate")
    cluster2.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    dp = cluster2.data_parallel(name)
    batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in "ab"]
    cluster2.zero_grad(name)
    for x, y in batches:
        F.mse_loss(dp(x), y).backward()
        F.mse_loss(local(x), y).backward()
    cluster2.all_reduce_gradients(name, op="sum")
    _check_grads(cluster2, name, local)
    # A second reduction reduces the reduced gradients again (each rank holds the sum).
    cluster2.all_reduce_gradients(name, op="avg")
    _check_grads(cluster2, name, local)
    cluster2.zero_grad(name)
    assert cluster2.gradients(name, rank=0) == {}
    x, y = batches[0]
    F.mse_loss(dp(x), y).backward()
    local.zero_grad()
    F.mse_loss(local(x), y).backward()
    cluster2.all_reduce_gradients(name, op="sum")
    _check_grads(cluster2, name, local)


def test_train_step_with_an_unreached_parameter_matches_local(cluster3, gen, uname) -> None:
    model = _model(gen)
    local = copy.deepcopy(model)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.2, momentum=0.5, weight_decay=0.1)
    name = uname("ddp")
    cluster3.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    x, y = torch.randn(12, 6, generator=gen), torch.randn(12, 3, generator=gen)
    xs, ys = uname("x"), uname("y")
    cluster3.scatter(xs, x)
    cluster3.scatter(ys, y)
    hyper = {"lr": 0.2, "momentum": 0.5, "weight_decay": 0.1}
    for _ in range(4):
        remote = cluster3.train_step(name, xs, ys, loss="mse", optimizer="sgd", **hyper)
        local_opt.zero_grad()
        loss = F.mse_loss(local(x), y)
        loss.backward()
        local_opt.step()
        value = float(loss.detach())
        assert abs(remote - value) <= RTOL * abs(value) + ATOL
    _check_grads(cluster3, name, local)
    for rank in range(3):
        state = cluster3.state_dict(name, rank=rank)
        for key, value in local.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)
