"""Model factories shipped with the server, for ``load_model(factory=...)``.

A factory builds a model on the worker from JSON arguments, so models that
``torch.export`` cannot capture (data-dependent control flow, namedtuple
outputs, custom Python) can still run on the cluster, without any code on the
wire. Workers only call factories from modules the operator allowed:

    collectives-server worker --coordinator H:P --allow-factory collectives_server.model_zoo

Your own factories work the same way: a module importable on the workers, a
function taking JSON-compatible keyword arguments and returning an nn.Module.
Factories are deterministic given ``seed``, so every worker builds the same
initial weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = ["mlp", "two_heads", "Heads"]


# Hidden layers an MLP may have: far more than any useful one, few enough that
# building it (a Python loop) stays quick.
MAX_DEPTH = 1024


def _count(name: str, value: object, low: int = 1, high: int | None = None) -> int:
    """``value`` as a count in [low, high]; ValueError naming the argument otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def mlp(
    in_features: int, hidden: int, out_features: int, depth: int = 2, seed: int = 0
) -> nn.Module:
    """A tanh MLP with ``depth`` hidden layers."""
    for name, value in (("in_features", in_features), ("hidden", hidden)):
        _count(name, value)
    _count("out_features", out_features)
    _count("depth", depth, 0, MAX_DEPTH)
    _count("seed", seed, 0)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        return nn.Sequential(*layers)
    finally:
        torch.random.set_rng_state(generator_state)


class Heads(NamedTuple):
    scores: torch.Tensor
    total: torch.Tensor


class TwoHeads(nn.Module):
    """Returns a namedtuple, which torch.export archives cannot carry."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.body = nn.Linear(in_features, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> Heads:
        h = torch.relu(self.body(x)) * scale
        return Heads(scores=h, total=h.sum(dim=1))


def two_heads(in_features: int, seed: int = 0) -> nn.Module:
    _count("in_features", in_features)
    _count("seed", seed, 0)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return TwoHeads(in_features)
    finally:
        torch.random.set_rng_state(generator_state)
