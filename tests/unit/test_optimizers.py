"""The optimizer swap rule (worker/optimizers.py), with torch as the oracle.

Same kind with new hyperparameters keeps the optimizer's state, as assigning
``param_groups[i]["lr"]`` does in torch; a different kind starts fresh; a plan
changes nothing until it is installed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from collectives.errors import InvalidArgument
from collectives.wire import names
from collectives_server.worker.engine.handlers.model_ops import LOSSES
from collectives_server.worker.models.optimizers import OPTIMIZERS, install, plan_optimizer
from collectives_server.worker.models.registry import HostedModel


def _hosted(gen: torch.Generator) -> HostedModel:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    module = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    return HostedModel("m", module, "test", [torch.device("cpu")])


def _backward(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    nn.functional.mse_loss(module(x), y).backward()


def _step(model: HostedModel, kind: str, hyper: dict) -> torch.optim.Optimizer:
    with model.lock:
        optimizer = install(model, plan_optimizer(model, kind, hyper))
        optimizer.step()
    return optimizer


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)


def test_sgd_keeps_momentum_across_an_lr_change_like_torch(gen) -> None:
    model = _hosted(gen)
    oracle = copy.deepcopy(model.module)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    hyper = {"lr": 0.1, "momentum": 0.9}
    first = None
    for i in range(6):
        if i == 3:  # an lr schedule: torch changes param_groups, momentum stays
            hyper = {"lr": 0.025, "momentum": 0.9}
            oracle_opt.param_groups[0]["lr"] = 0.025
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)
        _backward(model.module, x, y)
        _backward(oracle, x, y)
        optimizer = _step(model, "sgd", hyper)
        oracle_opt.step()
        first = first or optimizer
        assert optimizer is first  # never rebuilt: the momentum buffers are the same objects
    assert model.optimizer_hyper == hyper and optimizer.param_groups[0]["lr"] == 0.025
    _assert_same_params(model.module, oracle)
    for p, q in zip(model.module.parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(
            optimizer.state[p]["momentum_buffer"],
            oracle_opt.state[q]["momentum_buffer"],
            rtol=0,
            atol=0,
        )


def test_a_different_kind_starts_fresh(gen) -> None:
    model = _hosted(gen)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)
    _backward(model.module, x, y)
    sgd = _step(model, "sgd", {"lr": 0.1, "momentum": 0.9})
    with model.lock:
        plan = plan_optimizer(model, "adam", {"lr": 0.01})
        assert plan.fresh and model.optimizer is sgd  # nothing changes before install
        adam = install(model, plan)
    assert isinstance(adam, torch.optim.Adam) and model.optimizer_kind == "adam"
    assert len(adam.state) == 0  # no moments, no step count carried over
    oracle = copy.deepcopy(model.module)
    oracle_opt = torch.optim.Adam(oracle.parameters(), lr=0.01)
    _backward(model.module, x, y)
    _backward(oracle, x, y)
    adam.step()
    oracle_opt.step()
    _assert_same_params(model.module, oracle)
    assert all(int(s["step"]) == 1 for s in adam.state.values())


def test_an_uninstalled_plan_changes_nothing(gen) -> None:
    model = _hosted(gen)
    _backward(model.module, torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen))
    sgd = _step(model, "sgd", {"lr": 0.1, "momentum": 0.9})
    with model.lock:
        plan = plan_optimizer(model, "sgd", {"lr": 0.5, "momentum": 0.9})
    assert not plan.fresh and plan.optimizer is sgd
    assert sgd.param_groups[0]["lr"] == 0.1 and model.optimizer_hyper["lr"] == 0.1


def test_omitted_hyperparameters_take_the_kinds_defaults(gen) -> None:
    model = _hosted(gen)
    _backward(model.module, torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen))
    sgd = _step(model, "sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True})
    again = _step(model, "sgd", {"lr": 0.1})
    assert again is sgd  # state kept...
    group = again.param_groups[0]
    assert group["momentum"] == 0 and group["nesterov"] is False  # ...settings as sent


def test_switching_amsgrad_on_starts_fresh(gen) -> None:
    model = _hosted(gen)
    _backward(model.module, torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen))
    adam = _step(model, "adam", {"lr": 0.01})
    ams = _step(model, "adam", {"lr": 0.01, "amsgrad": True})  # torch's step would KeyError
    assert ams is not adam and all(int(s["step"]) == 1 for s in ams.state.values())


@pytest.mark.parametrize(
    ("kind", "hyper"),
    [("rmsprop", {}), ("sgd", {"lr": 0.1, "betas": (0.9, 0.99)}), ("sgd", {"lr": -1.0})],
)
def test_invalid_requests_leave_the_optimizer_alone(gen, kind, hyper) -> None:
    model = _hosted(gen)
    _backward(model.module, torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen))
    sgd = _step(model, "sgd", {"lr": 0.1, "momentum": 0.9})
    with model.lock, pytest.raises(InvalidArgument):
        plan_optimizer(model, kind, hyper)
    assert model.optimizer is sgd and model.optimizer_hyper == {"lr": 0.1, "momentum": 0.9}


def test_the_workers_know_exactly_the_names_the_sdk_offers() -> None:
    assert tuple(OPTIMIZERS) == names.OPTIMIZERS
    assert tuple(LOSSES) == names.BUILTIN_LOSSES
