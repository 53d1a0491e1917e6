"""A client exports a module once per input signature and set of weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from collectives.errors import InvalidArgument
from collectives.models.programs import FunctionModule, ProgramCache, as_module, program_name


def test_the_same_module_and_signature_is_exported_once() -> None:
    cache = ProgramCache()
    model = nn.Linear(3, 2)
    first = cache.archive(model, (torch.randn(4, 3),))
    assert cache.archive(model, (torch.randn(7, 3),)) is first  # dim 0 is dynamic


def test_new_weights_another_signature_or_mode_export_again() -> None:
    cache = ProgramCache()
    model = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.5))
    first = cache.archive(model, (torch.randn(4, 3),))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # in place: the version counter moves
    second = cache.archive(model, (torch.randn(4, 3),))
    assert second is not first and second != first
    assert cache.archive(model, (torch.randn(4, 3, dtype=torch.float64).float(),)) is second
    model.eval()
    assert cache.archive(model, (torch.randn(4, 3),)) is not second


def test_functions_are_named_by_their_archive() -> None:
    module = as_module(lambda t: t * 2, "fn")
    assert isinstance(module, FunctionModule)
    archive = ProgramCache().archive(module, (torch.randn(2, 2),))
    assert program_name(archive).startswith("__fn/") and len(program_name(archive)) == 21
    assert program_name(archive) == program_name(bytes(archive))


def test_where_a_program_is_loaded_is_remembered_until_forgotten() -> None:
    cache = ProgramCache()
    cache.mark_loaded("__fn/x", frozenset({"w-1", "w-2"}))
    assert cache.loaded_on("__fn/x", frozenset({"w-2"}))
    assert not cache.loaded_on("__fn/x", frozenset({"w-2", "w-3"}))
    cache.forget("__fn/x")
    assert not cache.loaded_on("__fn/x", frozenset({"w-1"}))


def test_weights_given_new_storage_export_again() -> None:
    """``p.data = t`` moves no version counter: the cache must still see new weights."""
    cache = ProgramCache()
    model = nn.Linear(3, 2)
    first = cache.archive(model, (torch.randn(4, 3),))
    model.weight.data = torch.randn(2, 3)
    assert cache.archive(model, (torch.randn(4, 3),)) is not first


def test_the_batch_dim_is_the_dynamic_one_and_part_of_the_key() -> None:
    """``load_model(batch_dim=1)``: dim 1 varies freely, the other sizes are fixed."""
    cache = ProgramCache()
    model = nn.Linear(3, 2)
    first = cache.archive(model, (torch.randn(5, 4, 3),), 1)
    assert cache.archive(model, (torch.randn(5, 9, 3),), 1) is first
    assert cache.archive(model, (torch.randn(5, 4, 3),), 0) is not first
    with pytest.raises(InvalidArgument, match="batch_dim must be an int"):
        cache.archive(model, (torch.randn(5, 4, 3),), "1")  # type: ignore[arg-type]


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_a_module_changed_without_its_weights_exports_again() -> None:
    """A swapped activation, a plain attribute, a dropout rate or a hook changes what
    the module computes with no weight changing: the client used to send the old
    program again (the cluster kept running Tanh after ``m[1] = nn.ReLU()``)."""
    cache = ProgramCache()
    x = (torch.randn(4, 3),)
    stack = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    first = cache.archive(stack, x)
    assert cache.archive(stack, x) is first
    stack[1] = nn.ReLU()
    swapped = cache.archive(stack, x)
    assert swapped is not first
    handle = stack.register_forward_hook(lambda _m, _i, out: out * 2)
    hooked = cache.archive(stack, x)
    assert hooked is not swapped
    handle.remove()
    assert cache.archive(stack, x) is not hooked
    scaled = _Scaled()
    before = cache.archive(scaled, x)
    scaled.scale = 3.0
    assert cache.archive(scaled, x) is not before
    dropping = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.5))
    rate = cache.archive(dropping, x)
    dropping[1].p = 0.1
    assert cache.archive(dropping, x) is not rate
