"""A multi-GPU worker's kept copies of a model (``device_replicas``): made once,
remade whenever a weight changes by any road, never served stale.

The copies themselves need GPUs (``nn.parallel.replicate`` broadcasts over CUDA);
here a deep copy per device id stands in for it, and each copy's output is
compared with the module's own on fresh random inputs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from collectives_server.worker.models.device_replicas import DeviceReplicas


def _deep_copies(module: nn.Module, device_ids: list[int]) -> list[nn.Module]:
    return [copy.deepcopy(module) for _ in device_ids]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).eval()


def _serves_current(replicas: DeviceReplicas, module: nn.Module, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = module(x)
        for i, c in enumerate(replicas.copies(module)):
            assert torch.equal(c(x), want), f"copy {i} serves other weights"


def test_copies_are_made_once_while_the_weights_stay_the_same(seed: int) -> None:
    module = _model(seed)
    replicas = DeviceReplicas([0, 1], replicate=_deep_copies)
    first = replicas.copies(module)
    assert len(first) == 2
    for _ in range(3):
        assert replicas.copies(module) is first
    assert replicas.made == 1
    _serves_current(replicas, module, seed)


def test_every_road_that_changes_a_weight_remakes_the_copies(seed: int) -> None:
    module = _model(seed)
    replicas = DeviceReplicas([0, 1], replicate=_deep_copies)
    replicas.copies(module)
    made = replicas.made

    def changed(what: str) -> None:
        nonlocal made
        _serves_current(replicas, module, seed + made)
        assert replicas.made == made + 1, f"{what}: copies not remade"
        made = replicas.made

    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module.train()
    module(torch.randn(8, 6)).square().mean().backward()  # also moves BN's running stats
    module.eval()
    changed("a train-mode forward (buffers)")
    optimizer.step()
    changed("an optimizer step (in place)")
    other = _model(seed + 1).state_dict()
    module.load_state_dict(other)
    changed("load_state_dict")
    module[0].weight = nn.Parameter(torch.randn(5, 6))
    changed("a parameter replaced")
    with torch.no_grad():
        module[2].bias.add_(1.0)
    changed("an in-place write")
    _serves_current(replicas, module, seed)
    assert replicas.made == made  # and unchanged weights again reuse them


def test_models_served_side_by_side_keep_their_copies_and_a_third_evicts_the_oldest(
    seed: int,
) -> None:
    a, b, c = _model(seed), _model(seed + 1), _model(seed + 2)
    replicas = DeviceReplicas([0, 1], replicate=_deep_copies)
    for module in (a, b, a, b):
        _serves_current(replicas, module, seed)
    assert replicas.made == 2
    _serves_current(replicas, c, seed)  # evicts a (b was used last)
    _serves_current(replicas, b, seed)
    assert replicas.made == 3
    _serves_current(replicas, a, seed)
    assert replicas.made == 4
