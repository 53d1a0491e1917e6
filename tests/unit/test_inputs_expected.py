"""A call that does not match an exported model's inputs is told what it takes and what came.

Real ``torch.export`` programs, loaded back as the worker loads them
(``torch.export.load(...).module()``); the message is built only after the
program refused the call.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from collectives_server.worker.models.inputs_expected import inputs_mismatch


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, pair: tuple, inputs: dict, *, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(pair[0] + inputs["x"]) * scale + pair[1].sum()


def _loaded(module: nn.Module, args: tuple, kwargs: dict | None = None) -> nn.Module:
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(module, args, kwargs), buffer)
    buffer.seek(0)
    return torch.export.load(buffer).module()


def _refused(program: nn.Module, args: tuple, kwargs: dict) -> str:
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        program(*args, **kwargs)
    message = inputs_mismatch("m", args, kwargs, program)
    assert message is not None
    return message


def test_a_plain_model_names_its_one_tensor_and_what_came() -> None:
    program = _loaded(nn.Linear(3, 2), (torch.randn(4, 3),))
    x = torch.randn(4, 3)
    assert _refused(program, (x, x), {}).startswith(
        "model 'm' takes 1 positional input (a tensor), got 2: (tensor, tensor); "
    )
    assert "got 1: ({'a': tensor, 'b': [tensor, None]})" in _refused(
        program, ({"b": [x, None], "a": x},), {}
    )
    assert "and no keyword inputs, got 1: (tensor) and keywords y=tensor" in _refused(
        program, (x,), {"y": x}
    )
    assert inputs_mismatch("m", (x,), {}, program) is None  # the right form: nothing to say


def test_nested_inputs_and_keywords_are_spelled_like_the_call() -> None:
    t = torch.randn(4, 3)
    program = _loaded(Nested(), ((t, t), {"x": t}), {"scale": torch.ones(1)})
    message = _refused(program, ((t,), {"x": t}), {"scale": torch.ones(1)})
    assert message.startswith(
        "model 'm' takes 2 positional inputs ((tensor, tensor), {'x': tensor}) and 1 keyword "
        "input scale=tensor, got 2: ((tensor,), {'x': tensor}) and keywords scale=tensor; "
    ), message


def test_a_module_that_is_not_an_exported_program_leaves_the_message_to_torch() -> None:
    x = torch.randn(4, 3)
    assert inputs_mismatch("m", (x, x), {}, nn.Linear(3, 2)) is None
