"""Models on their way from a peer (``ModelRegistry.expect``): the next generation's
exchange waits for them to be hosted before telling its inventory."""

from __future__ import annotations

import threading

import torch
from torch import nn

from collectives_server.worker.models.registry import ModelRegistry

_WAIT_S = 10.0


def _registry() -> ModelRegistry:
    return ModelRegistry([torch.device("cpu")])


def test_nothing_on_its_way_returns_at_once() -> None:
    assert _registry().await_arrivals(0.0) == []


def test_a_model_hosted_meanwhile_ends_the_wait_and_is_in_the_inventory() -> None:
    models = _registry()
    first, second = models.expect("a"), models.expect("b")
    assert first is not None and second is not None
    assert models.expect("a") is None  # already on its way
    waiting = threading.Event()
    result: list[list[str]] = []

    def wait() -> None:
        waiting.set()
        result.append(models.await_arrivals(_WAIT_S))

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert waiting.wait(_WAIT_S)
    models.add("a", nn.Linear(3, 2), "test")
    assert waiter.is_alive()  # "b" is still on its way
    models.give_up("b", second)  # (a build that failed)
    waiter.join(_WAIT_S)
    assert result == [[]]
    assert [m.name for m in models.all()] == ["a"]
    assert first.is_set() and not models.pending("a")


def test_a_model_still_on_its_way_at_the_deadline_is_named() -> None:
    models = _registry()
    assert models.expect("slow") is not None
    assert models.await_arrivals(0.05) == ["slow"]
    assert models.pending("slow")
