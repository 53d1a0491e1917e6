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


def mlp(
    in_features: int, hidden: int, out_features: int, depth: int = 2, seed: int = 0
) -> nn.Module:
    """A tanh MLP with ``depth`` hidden layers."""
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
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return TwoHeads(in_features)
    finally:
        torch.random.set_rng_state(generator_state)
