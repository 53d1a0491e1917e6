"""The user's own code on the workers, as exported programs: ``apply``, a custom
loss in ``train_step``, and gradient clipping.

Nothing is unpickled: the SDK exports each function with ``torch.export`` and
the workers check its operators as they check a model's. Every result is
compared with the same computation done locally by torch on the same inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

import collectives

RTOL, ATOL = 1e-4, 1e-6


def _shards(cluster, name: str, rows: list[int], cols: int, gen: torch.Generator):
    """A tensor of ``rows[r]`` x ``cols`` random values put on each rank ``r``."""
    tensors = [torch.randn(n, cols, generator=gen) for n in rows]
    for rank, t in enumerate(tensors):
        cluster.put(name, t, rank=rank)
    return tensors


def test_apply_runs_a_function_on_each_ranks_own_tensors(cluster2, gen, uname) -> None:
    a, b, s, m = uname("a"), uname("b"), uname("sum"), uname("max")
    xs = _shards(cluster2, a, [3, 5], 4, gen)  # other row counts per rank: dim 0 is dynamic
    ys = _shards(cluster2, b, [3, 5], 4, gen)

    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * y + 1.5, torch.maximum(x, y).amax(dim=1)

    cluster2.apply(fn, inputs=[a, b], out=[s, m])

    for rank in range(2):
        want_s, want_m = fn(xs[rank], ys[rank])
        torch.testing.assert_close(cluster2.get(s, rank=rank), want_s)
        torch.testing.assert_close(cluster2.get(m, rank=rank), want_m)


def test_apply_of_a_module_on_some_ranks_replaces_its_output(cluster2, gen, uname) -> None:
    x = uname("x")
    xs = _shards(cluster2, x, [2, 6], 3, gen)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = nn.Linear(3, 3).eval()

    cluster2.apply(layer, inputs=x, out=x, ranks=[1])  # in place, rank 1 only

    torch.testing.assert_close(cluster2.get(x, rank=0), xs[0])
    with torch.no_grad():
        torch.testing.assert_close(cluster2.get(x, rank=1), layer(xs[1]), rtol=RTOL, atol=ATOL)


def test_apply_is_exported_once_and_loaded_once(cluster2, gen, uname) -> None:
    x, y = uname("x"), uname("y")
    _shards(cluster2, x, [4, 4], 2, gen)

    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    cluster2.apply(double, inputs=x, out=y)
    loaded = {m.name for m in cluster2.models()}
    cluster2.apply(double, inputs=x, out=y)
    assert {m.name for m in cluster2.models()} == loaded  # functions are not user models
    torch.testing.assert_close(cluster2.get(y, rank=0), cluster2.get(x, rank=0) * 2)


def test_apply_refuses_an_operator_off_the_allowlist(cluster2, gen, uname) -> None:
    """A program with a custom operator is refused as a model upload with one is."""
    lib = uname("lib").replace("/", "_").replace("-", "_").replace(".", "_").replace(":", "_")

    @torch.library.custom_op(f"{lib}::twice", mutates_args=())
    def twice(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    @twice.register_fake
    def _(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t)

    x = uname("x")
    _shards(cluster2, x, [2, 2], 2, gen)
    with pytest.raises(collectives.InvalidArgument) as info:
        cluster2.apply(lambda t: twice(t), inputs=x, out=uname("y"))
    assert "is not an aten operator" in info.value.message, info.value


def test_apply_says_what_is_wrong(cluster2, gen, uname) -> None:
    x = uname("x")
    _shards(cluster2, x, [2, 2], 2, gen)
    with pytest.raises(collectives.InvalidArgument, match="2 output names"):
        cluster2.apply(lambda t: t + 1, inputs=x, out=[uname("p"), uname("q")])
    with pytest.raises(collectives.NotFound, match="not found"):
        cluster2.apply(lambda t: t + 1, inputs=uname("absent"), out=uname("p"))
    with pytest.raises(collectives.InvalidArgument, match="out of range"):
        cluster2.apply(lambda t: t + 1, inputs=x, out=uname("p"), ranks=[5])
    with pytest.raises(collectives.InvalidArgument, match=r"nn\.Module or a function"):
        cluster2.apply("t + 1", inputs=x, out=uname("p"))


class _Huber(nn.Module):
    """A loss torch users write themselves: weighted Huber over the output."""

    def __init__(self, delta: float) -> None:
        super().__init__()
        self.delta = delta

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * F.huber_loss(output, target, delta=self.delta) + 0.1 * output.abs().mean()


def _mlp(gen: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _placed(cluster, gen: torch.Generator, uname, y: torch.Tensor | None = None):
    """A fresh MLP loaded on the cluster, its local copy, and a batch scattered to the
    workers: (model name, local copy, x, y, x's name, y's name)."""
    model = _mlp(gen)
    local = copy.deepcopy(model)
    name = uname("m")
    cluster.load_model(name, model, example_inputs=(torch.randn(4, 5),))
    x = torch.randn(8, 5, generator=gen)
    y = torch.randn(8, 3, generator=gen) if y is None else y
    xs, ys = uname("x"), uname("y")
    cluster.scatter(xs, x)
    cluster.scatter(ys, y)
    return name, local, x, y, xs, ys


def _local_ddp_step(model: nn.Module, loss_fn, xs, ys, clip: float | None) -> float:
    """What train_step does, locally: each shard's loss backpropagated, gradients
    averaged over the shards, clipped; returns the shards' mean loss."""
    model.zero_grad()
    grads: dict[str, torch.Tensor] = {}
    losses = []
    for x, y in zip(xs, ys, strict=True):
        model.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / len(xs)
    for n, p in model.named_parameters():
        p.grad = grads[n]
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return sum(losses) / len(losses)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["unclipped", "clipped"])
def test_train_step_with_a_custom_loss_matches_local(cluster2, gen, uname, clip) -> None:
    name, local, x, y, xs, ys = _placed(cluster2, gen, uname)
    loss = _Huber(delta=0.7)

    remote = cluster2.train_step(name, xs, ys, loss=loss, max_grad_norm=clip)

    want = _local_ddp_step(local, loss, list(x.chunk(2)), list(y.chunk(2)), clip)
    assert abs(remote - want) <= RTOL * abs(want) + ATOL, (remote, want)
    for rank in range(2):
        grads = cluster2.gradients(name, rank=rank)
        for n, p in local.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=RTOL, atol=ATOL)
    if clip is not None:
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
        assert float(norm) <= clip * (1 + 1e-4)


def test_train_step_with_a_function_loss_and_a_step_matches_local(cluster2, gen, uname) -> None:
    classes = torch.randint(0, 3, (8,), generator=gen)
    name, local, x, y, xs, ys = _placed(cluster2, gen, uname, y=classes)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.3)

    def smoothed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, label_smoothing=0.1)

    for _ in range(3):
        remote = cluster2.train_step(name, xs, ys, loss=smoothed, optimizer="sgd", lr=0.3)
        want = _local_ddp_step(local, smoothed, list(x.chunk(2)), list(y.chunk(2)), None)
        local_opt.step()
        assert abs(remote - want) <= RTOL * abs(want) + ATOL, (remote, want)
    state = cluster2.state_dict(name, rank=1)
    for key, value in local.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)


def test_step_clips_the_gradients_first(cluster2, gen, uname) -> None:
    name, local, x, y, xs, ys = _placed(cluster2, gen, uname)
    cluster2.train_step(name, xs, ys, loss="mse")  # averaged gradients, no step

    cluster2.step(name, "sgd", lr=1.0, max_grad_norm=0.01)

    _local_ddp_step(local, F.mse_loss, list(x.chunk(2)), list(y.chunk(2)), 0.01)
    torch.optim.SGD(local.parameters(), lr=1.0).step()
    state = cluster2.state_dict(name, rank=0)
    for key, value in local.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)
    with pytest.raises(collectives.InvalidArgument, match="max_grad_norm"):
        cluster2.step(name, "sgd", lr=1.0, max_grad_norm=-1.0)


def test_a_loss_that_is_not_a_number_is_refused_on_every_rank(cluster2, gen, uname) -> None:
    name, _, _, _, xs, ys = _placed(cluster2, gen, uname)
    with pytest.raises(collectives.InvalidArgument, match="one number"):
        cluster2.train_step(name, xs, ys, loss=lambda out, target: (out - target) ** 2)
