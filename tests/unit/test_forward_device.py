"""A forward's inputs reach the module on the module's device.

Inline inputs arrive decoded on the host; a CUDA worker's module lives on its
GPU, so ``dp(x)`` failed on every single-GPU worker with a device mismatch.
The worker's forward (``execution.forward``) runs here with ``meta`` standing in
for ``cuda``: the module and the store on ``meta``, the inputs on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from collectives.v1 import worker_pb2
from collectives.wire.pytree import fill_value
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.models import execution
from collectives_server.worker.models.registry import ModelRegistry

META = torch.device("meta")


def _request(name: str, inputs: tuple[str, ...]) -> worker_pb2.ForwardRequest:
    request = worker_pb2.ForwardRequest(model=name, call_id="call-1")
    names = iter(inputs)
    fill_value(request.args, tuple(torch.empty(0) for _ in inputs), lambda _t: next(names))
    return request


def test_inline_host_inputs_run_on_the_modules_device() -> None:
    registry = ModelRegistry([META])
    store = TensorStore(META)
    registry.add("mlp", nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), "test")
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    response = execution.forward(
        registry, store, _request("mlp", ("call-1/in/0",)), 10.0, inline={"call-1/in/0": x}
    )
    assert response.output.WhichOneof("kind") == "tensor", response
    out = store.get(response.output.tensor)
    assert out.device == META and out.shape == (5, 2)
