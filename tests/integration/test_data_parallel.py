"""Inference fan-out: ``dp(x)`` equals the model run locally, for every batch shape.

Batch sizes 1, world-1, world, 7 and 1000 on 2 and 3
workers, for an MLP and for a model with dict/tuple inputs and outputs; plus
the seed's scatter/gather semantics (kwargs, non-tensor arguments, namedtuple
and 0-dim outputs) and the error paths.
"""

from __future__ import annotations

import io
import zipfile

import grpc
import pytest
import torch
from torch import nn

import collectives
from collectives.v1 import tensor_pb2, worker_pb2, worker_pb2_grpc
from collectives.wire import codec


class DictModel(nn.Module):
    """Dict and tuple in, dict holding a tensor and a tuple out.

    (torch.export cannot serialize namedtuple outputs; those are covered by a
    factory-built model in test_factories.py.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, inputs: dict, extra: tuple) -> dict:
        h = torch.relu(self.a(inputs["x"]) + self.b(inputs["y"])) * extra[0]
        return {"h": h, "pair": (h.sum(1), extra[1] + h[:, :2])}


class _Hostile:
    """Unpickling this creates a file: code execution, made visible."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class ScalarLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).mean()


def _mlp(gen: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return nn.Sequential(
        nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _batches(world: int) -> list[int]:
    return sorted({1, max(world - 1, 1), world, 7, 1000})


def test_mlp_inference_matches_local(cluster, gen, uname) -> None:
    model = _mlp(gen)
    name = uname("mlp")
    cluster.load_model(name, model, example_inputs=(torch.randn(4, 6, generator=gen),))
    dp = cluster.data_parallel(name)
    assert isinstance(dp, collectives.DataParallel)  # the public type (issue 44)
    for batch in _batches(cluster.world_size):
        x = torch.randn(batch, 6, generator=gen)
        with torch.no_grad():
            out = dp(x)
        assert out.shape == (batch, 3)
        torch.testing.assert_close(out, model(x).detach())
    cluster.unload_model(name)


def test_nested_dict_tuple_inputs_and_outputs(cluster, gen, uname) -> None:
    model = DictModel()
    name = uname("dict")
    example = (
        {"x": torch.randn(4, 5), "y": torch.randn(4, 3)},
        (torch.randn(4, 4), torch.randn(4, 2)),
    )
    cluster.load_model(name, model, example_inputs=example)
    dp = cluster.data_parallel(name)
    for batch in _batches(cluster.world_size):
        inputs = {
            "x": torch.randn(batch, 5, generator=gen),
            "y": torch.randn(batch, 3, generator=gen),
        }
        extra = (torch.randn(batch, 4, generator=gen), torch.randn(batch, 2, generator=gen))
        with torch.no_grad():
            got = dp(inputs, extra)
            want = model(inputs, extra)
        assert set(got) == {"h", "pair"}
        torch.testing.assert_close(got["h"], want["h"])
        assert isinstance(got["pair"], tuple) and len(got["pair"]) == 2
        torch.testing.assert_close(got["pair"][0], want["pair"][0])
        torch.testing.assert_close(got["pair"][1], want["pair"][1])


class TimeMajor(nn.Module):
    """A sequence model on (time, batch, features) inputs: the batch is dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).cumsum(0)


def test_a_loaded_module_splits_along_the_batch_dim_it_was_loaded_with(cluster, gen, uname) -> None:
    """``load_model(..., batch_dim=1)`` exports dim 1 dynamic, so ``dim=1`` splits run."""
    model = TimeMajor()
    name = uname("time-major")
    cluster.load_model(name, model, example_inputs=(torch.randn(5, 4, 6),), batch_dim=1)
    dp = cluster.data_parallel(name, dim=1)
    for batch in _batches(cluster.world_size):
        x = torch.randn(5, batch, 6, generator=gen)
        with torch.no_grad():
            out = dp(x)
        assert out.shape == (5, batch, 4)
        torch.testing.assert_close(out, model(x).detach())
    x = torch.randn(5, 9, 6, generator=gen, requires_grad=True)  # and backward, on dim 1
    dp(x).pow(2).sum().backward()
    local = x.detach().requires_grad_()
    model(local).pow(2).sum().backward()
    assert x.grad is not None and local.grad is not None
    torch.testing.assert_close(x.grad, local.grad)
    cluster.unload_model(name)


def test_scalar_outputs_are_unsqueezed_with_the_seed_warning(cluster3, gen, uname) -> None:
    model = ScalarLoss()
    name = uname("scalar")
    cluster3.load_model(name, model, example_inputs=(torch.randn(6, 3),))
    x = torch.randn(9, 3, generator=gen)
    with pytest.warns(UserWarning, match="unsqueeze"), torch.no_grad():
        out = cluster3.data_parallel(name)(x)
    want = torch.stack([model(chunk) for chunk in torch.chunk(x, 3)]).detach()
    torch.testing.assert_close(out, want)


def test_input_gradients_flow_back(cluster3, gen, uname) -> None:
    model = _mlp(gen)
    name = uname("igrad")
    cluster3.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    x = torch.randn(8, 6, generator=gen, requires_grad=True)
    x_local = x.detach().clone().requires_grad_(True)
    cluster3.data_parallel(name)(x).square().sum().backward()
    model(x_local).square().sum().backward()
    torch.testing.assert_close(x.grad, x_local.grad)
    grads = cluster3.gradients(name, rank=0)
    assert set(grads) == {n for n, _ in model.named_parameters()}


class Wide(nn.Module):
    """A big and a small input, a big and a small output: beyond the inline budget."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 512)

    def forward(self, big: torch.Tensor, small: torch.Tensor) -> tuple:
        h = self.lin(big)
        return h, (h[:, :4] * small).sum(1)


def test_tensors_beyond_the_inline_budget_take_the_data_plane(cluster2, gen, uname) -> None:
    """Per worker, a 2 MiB input and output and their gradients exceed the
    1 MiB inline budget: they are put and got, the small ones travel inline."""
    model = Wide()
    name = uname("wide")
    cluster2.load_model(name, model, example_inputs=(torch.randn(4, 512), torch.randn(4, 4)))
    big = torch.randn(2048, 512, generator=gen, requires_grad=True)
    small = torch.randn(2048, 4, generator=gen, requires_grad=True)
    h, s = cluster2.data_parallel(name)(big, small)
    local_big = big.detach().clone().requires_grad_(True)
    local_small = small.detach().clone().requires_grad_(True)
    want_h, want_s = model(local_big, local_small)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(s, want_s)
    (h.square().mean() + s.sum()).backward()
    (want_h.square().mean() + want_s.sum()).backward()
    torch.testing.assert_close(big.grad, local_big.grad)
    torch.testing.assert_close(small.grad, local_small.grad)
    cluster2.unload_model(name)


def test_inline_tensors_are_validated(cluster2, cluster2_address, gen, uname) -> None:
    name = uname("inl")
    cluster2.load_model(name, _mlp(gen), example_inputs=(torch.randn(4, 6),))
    address = next(w.address for w in cluster2.workers() if w.rank == 0)
    x = torch.randn(3, 6, generator=gen)
    good = codec.tensor_to_proto(x)
    bad = tensor_pb2.Tensor(dtype=good.dtype, shape=[3, 6], data=good.data[:-4])
    cases = [
        ("other/in/0", good, "must be named under its call"),
        ("call1/in/0", bad, "inline tensor 'call1/in/0'"),
    ]
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for tensor_name, tensor, needle in cases:
            value = worker_pb2.Value(
                tuple=worker_pb2.ValueList(
                    items=[
                        worker_pb2.Value(
                            inline_tensor=worker_pb2.InlineTensor(name=tensor_name, tensor=tensor)
                        )
                    ]
                )
            )
            request = worker_pb2.ForwardRequest(model=name, call_id="call1", args=value)
            with pytest.raises(grpc.RpcError) as info:
                stub.Forward(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in info.value.details()
        # A well-formed one answers inline.
        value = worker_pb2.Value(
            tuple=worker_pb2.ValueList(
                items=[
                    worker_pb2.Value(
                        inline_tensor=worker_pb2.InlineTensor(name="call2/in/0", tensor=good)
                    )
                ]
            )
        )
        response = stub.Forward(
            worker_pb2.ForwardRequest(
                model=name, call_id="call2", args=value, inline_output_bytes=1 << 20
            ),
            timeout=30,
        )
        assert response.output.WhichOneof("kind") == "inline_tensor"
        assert not [
            t.name
            for t in stub.ListTensors(worker_pb2.ListTensorsRequest(), timeout=10).tensors
            if t.name.startswith(("call1/", "call2/"))
        ], "inline inputs or outputs were left in the store"
    cluster2.unload_model(name)


def test_backward_runs_once(cluster2, gen, uname) -> None:
    model = _mlp(gen)
    name = uname("once")
    cluster2.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    out = cluster2.data_parallel(name)(torch.randn(4, 6, generator=gen))
    out.sum().backward(retain_graph=True)
    with pytest.raises(collectives.InvalidArgument, match="runs once"):
        out.sum().backward()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_wrong_inputs_name_what_the_model_takes_and_what_came(cluster2, gen, uname, grad) -> None:
    model = _mlp(gen)
    name = uname("inputs")
    cluster2.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    dp = cluster2.data_parallel(name)
    x = torch.randn(8, 6, generator=gen)
    cases = [
        ((x, x), {}, "got 2: (tensor, tensor)"),
        (({"a": x},), {}, "got 1: ({'a': tensor})"),
        ((x, 3), {}, "got 2: (tensor, int)"),
        ((), {"x": x}, "and no keyword inputs, got none and keywords x=tensor"),
    ]
    for args, kwargs, got in cases:
        with pytest.raises(collectives.InvalidArgument) as info, torch.set_grad_enabled(grad):
            dp(*args, **kwargs)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        message = info.value.message
        assert f"model {name!r} takes 1 positional input (a tensor)" in message, message
        assert got in message and "example_inputs" in message, message
        assert "tree spec" not in message, message
    torch.testing.assert_close(dp(x).detach(), model(x).detach())  # and it still serves
    cluster2.unload_model(name)


def test_unknown_model_is_not_found(cluster2) -> None:
    with pytest.raises(collectives.NotFound, match="no-such-model"), torch.no_grad():
        cluster2.data_parallel("no-such-model")(torch.randn(4, 3))


def test_unexportable_module_names_the_reason_and_the_factory_alternative(cluster2, uname) -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow cannot be exported
                return x * 2
            return x

    with pytest.raises(collectives.InvalidArgument) as info:
        cluster2.load_model(uname("bad"), DataDependent(), example_inputs=(torch.randn(3, 2),))
    assert "torch.export" in info.value.message and "factory" in info.value.message


def test_pickled_sample_inputs_are_never_unpickled_and_the_worker_keeps_serving(
    cluster2, gen, uname, tmp_path
) -> None:
    """torch.export.load unpickles sample inputs (falling back to a full unpickle);
    the worker drops them from its checked copy, so the payload never runs."""
    marker = tmp_path / "marker"
    buffer = io.BytesIO()
    program = torch.export.export(nn.Linear(3, 2), (torch.randn(2, 3),))
    torch.export.save(program, buffer)
    hostile = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src,
        zipfile.ZipFile(hostile, "w") as dst,
    ):
        for info in src.infolist():
            body = src.read(info.filename)
            if info.filename.endswith("sample_inputs/model.pt"):
                evil = io.BytesIO()
                torch.save(_Hostile(str(marker)), evil)  # unpickling it creates marker
                body = evil.getvalue()
            dst.writestr(info, body)
    data = hostile.getvalue()
    address = next(w.address for w in cluster2.workers() if w.rank == 0)
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))
    name = uname("evil")
    requests = [
        worker_pb2.LoadModelRequest(spec=worker_pb2.ModelSpec(name=name, archive_nbytes=len(data))),
        worker_pb2.LoadModelRequest(archive_chunk=data),
    ]
    reply = stub.LoadModel(iter(requests), timeout=30)
    assert reply.model.source == "export"
    assert not marker.exists()
    model = _mlp(gen)
    good = uname("good")
    cluster2.load_model(good, model, example_inputs=(torch.randn(2, 6),))
    x = torch.randn(3, 6, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(cluster2.data_parallel(good)(x), model(x))


def test_graph_of_dropped_outputs_is_released(cluster2, gen, uname) -> None:
    model = _mlp(gen)
    name = uname("drop")
    cluster2.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    dp = cluster2.data_parallel(name)
    for _ in range(5):
        out = dp(torch.randn(4, 6, generator=gen))  # grad enabled, no backward
        del out
    import gc

    gc.collect()
    from helpers import wait_until

    def retained() -> int:
        total = 0
        for w in cluster2.workers():
            stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(w.address))
            models = stub.ListModels(worker_pb2.ListModelsRequest(), timeout=10).models
            total += sum(m.graphs_retained for m in models if m.name == name)
        return total

    wait_until(lambda: retained() == 0, 10, "retained graphs released")
