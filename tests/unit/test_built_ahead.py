"""Modules a drain's successor builds ahead (``models.built_ahead``): one is taken only
for the same definition, for an exported model the same archive bytes, and at most once."""

from __future__ import annotations

import io
import json

import torch
from torch import nn

from collectives.v1 import worker_pb2
from collectives_server.worker.models.archive.checks import ModelUploadConfig
from collectives_server.worker.models.archive.upload import ModelUploads
from collectives_server.worker.models.built_ahead import ModulesBuiltAhead

ZOO = "collectives_server.model_zoo"


def _archive(activation: nn.Module) -> torch.Tensor:
    """An exported model's archive bytes; two activations: same parameters, other graphs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), activation, nn.Linear(8, 2))
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(model, (torch.randn(2, 4),)), buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _uploads(tmp_path) -> ModelUploads:
    return ModelUploads(ModelUploadConfig(allow=True, load_sandbox=False, upload_dir=str(tmp_path)))


def test_an_archive_built_ahead_is_taken_only_for_the_same_bytes(tmp_path) -> None:
    uploads = _uploads(tmp_path)
    tanh, relu = _archive(nn.Tanh()), _archive(nn.ReLU())
    built = ModulesBuiltAhead()
    model = worker_pb2.ModelSpec(name="m", archive_nbytes=tanh.numel())
    try:
        assert built.build([model], {"m": tanh}, uploads, (), lambda: True) == ["m"]
        # The same name and parameters, another graph (a client reloaded it meanwhile).
        assert built.take("", "", relu) is None
        made = built.take("", "", tanh)
        assert made is not None and made.archive is not None and made.archive.exists()
        x = torch.randn(2, 4)
        reference = torch.export.load(io.BytesIO(tanh.numpy().tobytes())).module()
        assert torch.equal(made.module(x), reference(x))
        assert built.take("", "", tanh) is None  # taken once
    finally:
        uploads.close()


def test_a_factory_model_is_taken_for_the_same_factory_and_arguments(tmp_path) -> None:
    uploads = _uploads(tmp_path)
    kwargs = json.dumps({"in_features": 4, "hidden": 8, "out_features": 2, "depth": 1})
    other = json.dumps({"in_features": 4, "hidden": 16, "out_features": 2, "depth": 1})
    model = worker_pb2.ModelSpec(name="f", factory=f"{ZOO}:mlp", factory_kwargs_json=kwargs)
    built = ModulesBuiltAhead()
    try:
        assert built.build([model], {}, uploads, (ZOO,), lambda: True) == ["f"]
        assert built.take(f"{ZOO}:mlp", other, None) is None
        made = built.take(f"{ZOO}:mlp", kwargs, None)
        assert made is not None and made.archive is None
    finally:
        uploads.close()


def test_nothing_is_kept_once_the_drain_ended_or_after_clear(tmp_path) -> None:
    uploads = _uploads(tmp_path)
    tanh = _archive(nn.Tanh())
    model = worker_pb2.ModelSpec(name="m", archive_nbytes=tanh.numel())
    refused = worker_pb2.ModelSpec(name="f", factory="os:getcwd", factory_kwargs_json="{}")
    built = ModulesBuiltAhead()
    try:
        # Its drain ended while it was built: dropped, its kept archive deleted.
        assert built.build([model], {"m": tanh}, uploads, (), lambda: False) == []
        assert built.take("", "", tanh) is None
        # A factory not allowed here is left to the exchange (which refuses it too).
        assert built.build([refused, model], {"m": tanh}, uploads, (), lambda: True) == ["m"]
        built.clear()
        assert built.take("", "", tanh) is None
        assert not [p for p in tmp_path.iterdir() if p.suffix == ".pt2"], "a kept archive stayed"
    finally:
        uploads.close()
