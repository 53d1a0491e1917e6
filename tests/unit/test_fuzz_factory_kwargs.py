"""``factory_kwargs_json`` fuzzed: whatever JSON arrives, a factory build ends in a
model, ``INVALID_ARGUMENT`` or ``RESOURCE_EXHAUSTED`` — never another error, and
never an allocation beyond the worker's --max-model-bytes (the factory runs on
the meta device first)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from collectives.errors import InvalidArgument, ResourceExhausted
from collectives_server.worker.models.registry import build_from_factory

ZOO = ("collectives_server.model_zoo",)
MAX_BYTES = 4 << 20

_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3), max_leaves=4)
_keys = st.sampled_from(["in_features", "hidden", "out_features", "depth", "seed", "bogus"])


@settings(max_examples=400, deadline=None)
@given(kwargs=st.dictionaries(_keys, _value, max_size=6))
def test_mlp_kwargs_build_or_are_refused_clearly(kwargs) -> None:
    try:
        text = json.dumps(kwargs)
    except ValueError:
        return
    try:
        module = build_from_factory("collectives_server.model_zoo:mlp", text, ZOO, MAX_BYTES)
    except InvalidArgument as err:
        assert "rejected its arguments" in err.message or "JSON" in err.message, err.message
        assert "frame #" not in err.message and "/" not in err.message.split(":", 1)[0]
        return
    except ResourceExhausted as err:
        assert str(MAX_BYTES) in err.message
        return
    assert isinstance(module, nn.Module)
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert nbytes <= MAX_BYTES


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"in_features": 4, "hidden": -3, "out_features": 2}, InvalidArgument, "hidden"),
        ({"in_features": 4, "hidden": 3, "out_features": 0}, InvalidArgument, "out_features"),
        ({"in_features": 4, "hidden": 3, "out_features": 2, "depth": 10**9}, InvalidArgument,
         "depth must be between 0 and 1024"),
        ({"in_features": 1 << 20, "hidden": 1 << 20, "out_features": 2}, ResourceExhausted,
         f"--max-model-bytes is {MAX_BYTES}"),
    ],
)  # fmt: skip
def test_named_refusals(kwargs, error, words) -> None:
    with pytest.raises(error) as info:
        build_from_factory("collectives_server.model_zoo:mlp", json.dumps(kwargs), ZOO, MAX_BYTES)
    assert words in info.value.message
