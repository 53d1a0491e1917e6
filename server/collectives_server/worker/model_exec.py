"""Forward and backward of hosted models on tensors in the worker's store.

The SDK uploads each worker's shard of the inputs as named tensors
(``<call_id>/in/<i>``) and sends the nested structure as a ``Value``; the
worker runs the model (over its local devices when it has several, like
``torch.nn.DataParallel``), stores the output leaves as ``<call_id>/out/<i>``
for the SDK to stream back (and consume), and, when autograd is on, keeps the
graph for the client's backward.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from collectives.errors import InvalidArgument, NotFound
from collectives.v1 import worker_pb2
from collectives_server.worker.models import HostedModel, ModelRegistry, RetainedGraph
from collectives_server.worker.store import TensorStore

__all__ = ["from_value", "to_value", "forward", "backward", "release"]

_NAMEDTUPLE_TYPES: dict[tuple[str, tuple[str, ...]], type] = {}


def _namedtuple_type(type_name: str, fields: tuple[str, ...]) -> type:
    key = (type_name, fields)
    if key not in _NAMEDTUPLE_TYPES:
        safe = type_name if type_name.isidentifier() else "Output"
        _NAMEDTUPLE_TYPES[key] = collections.namedtuple(safe, fields)  # type: ignore[misc]
    return _NAMEDTUPLE_TYPES[key]


def from_value(value: worker_pb2.Value, load: Callable[[str], torch.Tensor]) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        return load(value.tensor)
    if kind in ("int_value", "float_value", "str_value", "bool_value"):
        return getattr(value, kind)
    if kind == "none" or kind is None:
        return None
    if kind == "list":
        return [from_value(v, load) for v in value.list.items]
    if kind == "tuple":
        return tuple(from_value(v, load) for v in value.tuple.items)
    if kind == "dict":
        if len(value.dict.keys) != len(value.dict.values):
            raise InvalidArgument("malformed dict value: keys and values differ in length")
        return {
            k: from_value(v, load) for k, v in zip(value.dict.keys, value.dict.values, strict=True)
        }
    if kind == "named_tuple":
        nt = value.named_tuple
        cls = _namedtuple_type(nt.type_name, tuple(nt.fields))
        return cls(*(from_value(v, load) for v in nt.values))
    raise InvalidArgument(f"unsupported value kind {kind!r}")


def to_value(obj: Any, store_leaf: Callable[[torch.Tensor], str]) -> worker_pb2.Value:
    if isinstance(obj, torch.Tensor):
        return worker_pb2.Value(tensor=store_leaf(obj))
    if obj is None:
        return worker_pb2.Value(none=True)
    if isinstance(obj, bool):
        return worker_pb2.Value(bool_value=obj)
    if isinstance(obj, int):
        return worker_pb2.Value(int_value=obj)
    if isinstance(obj, float):
        return worker_pb2.Value(float_value=obj)
    if isinstance(obj, str):
        return worker_pb2.Value(str_value=obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return worker_pb2.Value(
            named_tuple=worker_pb2.NamedTupleValue(
                type_name=type(obj).__name__,
                fields=list(obj._fields),
                values=[to_value(v, store_leaf) for v in obj],
            )
        )
    if isinstance(obj, tuple):
        return worker_pb2.Value(
            tuple=worker_pb2.ValueList(items=[to_value(v, store_leaf) for v in obj])
        )
    if isinstance(obj, list):
        return worker_pb2.Value(
            list=worker_pb2.ValueList(items=[to_value(v, store_leaf) for v in obj])
        )
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise InvalidArgument("the model returned a dict with non-str keys; use str keys")
        return worker_pb2.Value(
            dict=worker_pb2.ValueDict(
                keys=list(obj), values=[to_value(v, store_leaf) for v in obj.values()]
            )
        )
    raise InvalidArgument(
        f"the model returned a {type(obj).__name__}; outputs must be tensors, numbers, "
        "strings, None, or tuples/lists/dicts/namedtuples of them"
    )


def _run(model: HostedModel, args: tuple, kwargs: dict) -> Any:
    devices = model.devices
    if len(devices) > 1 and all(d.type == "cuda" for d in devices):
        return nn.parallel.data_parallel(
            model.module,
            args,
            device_ids=[d.index for d in devices],
            output_device=devices[0].index,
            module_kwargs=kwargs,
        )
    return model.module(*args, **kwargs)


def forward(
    registry: ModelRegistry, store: TensorStore, request: worker_pb2.ForwardRequest
) -> worker_pb2.ForwardResponse:
    started = time.perf_counter()
    model = registry.get(request.model)
    registry.expire_graphs()
    call_id = request.call_id
    if not call_id:
        raise InvalidArgument("forward needs a call_id")
    wanted = list(request.input_grad_names)
    leaves: dict[str, torch.Tensor] = {}

    def load(name: str) -> torch.Tensor:
        t = store.get(name)
        if name in wanted and request.grad_enabled:
            if not (t.dtype.is_floating_point or t.dtype.is_complex):
                raise InvalidArgument(f"input {name!r} of dtype {t.dtype} cannot require grad")
            t = leaves.setdefault(name, t.detach().requires_grad_(True))
        return t

    try:
        args = from_value(request.args, load) if request.HasField("args") else ()
        kwargs = from_value(request.kwargs, load) if request.HasField("kwargs") else {}
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise InvalidArgument("forward args must be a tuple value and kwargs a dict value")
        with model.lock, torch.set_grad_enabled(request.grad_enabled):
            try:
                output = _run(model, args, kwargs)
            except (RuntimeError, TypeError, ValueError, IndexError) as exc:
                raise InvalidArgument(
                    f"model {request.model!r} failed on these inputs: {type(exc).__name__}: {exc}"
                ) from None
        stored: dict[str, torch.Tensor] = {}

        def store_leaf(t: torch.Tensor) -> str:
            name = f"{call_id}/out/{len(stored)}"
            stored[name] = t
            store.put(name, t.detach())
            return name

        value = to_value(output, store_leaf)
        if request.grad_enabled and any(t.requires_grad for t in stored.values()):
            with model.lock:
                model.graphs[call_id] = RetainedGraph(
                    outputs=stored,
                    inputs={n: leaves[n] for n in wanted if n in leaves},
                    expires_at=time.monotonic() + registry.graph_ttl_s,
                )
    finally:
        store.delete_prefix(f"{call_id}/in/")
    return worker_pb2.ForwardResponse(output=value, latency_s=time.perf_counter() - started)


def backward(
    registry: ModelRegistry, store: TensorStore, request: worker_pb2.BackwardRequest
) -> worker_pb2.BackwardResponse:
    started = time.perf_counter()
    model = registry.get(request.model)
    call_id = request.call_id
    try:
        with model.lock:
            graph = model.graphs.pop(call_id, None)
        if graph is None:
            raise NotFound(
                f"no retained graph {call_id!r} for model {request.model!r}: it was already "
                f"used, released, or expired after {registry.graph_ttl_s:.0f}s without backward"
            )
        if len(request.output_names) != len(request.grad_names):
            raise InvalidArgument("backward needs one grad name per output name")
        tensors, grads = [], []
        for out_name, grad_name in zip(request.output_names, request.grad_names, strict=True):
            out = graph.outputs.get(out_name)
            if out is None:
                raise InvalidArgument(f"{out_name!r} is not an output of call {call_id!r}")
            if not grad_name or not out.requires_grad:
                continue
            grad = store.get(grad_name)
            if grad.shape != out.shape:
                raise InvalidArgument(
                    f"gradient for {out_name!r} has shape {list(grad.shape)}, "
                    f"the output has {list(out.shape)}"
                )
            tensors.append(out)
            grads.append(grad.to(out.device, out.dtype))
        with model.lock:
            if tensors:
                torch.autograd.backward(tensors, grads)
        names = []
        for i, (name, leaf) in enumerate(graph.inputs.items()):
            if leaf.grad is None:
                names.append("")
                continue
            grad_name = f"{call_id}/igrad/{i}"
            store.put(grad_name, leaf.grad)
            names.append(grad_name)
            del name
    finally:
        store.delete_prefix(f"{call_id}/grad/")
    return worker_pb2.BackwardResponse(
        input_grad_names=names, latency_s=time.perf_counter() - started
    )


def release(registry: ModelRegistry, store: TensorStore, model_name: str, call_id: str) -> bool:
    model = registry.peek(model_name)
    store.delete_prefix(f"{call_id}/")
    if model is None:
        return False
    with model.lock:
        return model.graphs.pop(call_id, None) is not None
