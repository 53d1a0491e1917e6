"""Forward and backward of hosted models on tensors in the worker's store.

The SDK uploads each worker's shard of the inputs as named tensors
(``<call_id>/in/<i>``) and sends the nested structure as a ``Value``; the
worker runs the model (over its local devices when it has several, like
``torch.nn.DataParallel``; merged with other callers' forwards when the model
batches, :mod:`batching`), stores the output leaves as ``<call_id>/out/<i>``
for the SDK to stream back (and consume), or carries them in the response
while they fit in the bytes the caller allows, and, when autograd is on, keeps
the graph for the client's backward.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from collectives.errors import FailedPrecondition, InvalidArgument, NotFound, Reason
from collectives.v1 import worker_pb2
from collectives.wire.names import reserved_prefix, validate_name
from collectives.wire.pytree import InlineLeaf, fill_value, from_value
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.kernels.op_failures import backend_message
from collectives_server.worker.models import modes as model_modes
from collectives_server.worker.models import versions as model_versions
from collectives_server.worker.models.batching import company_of
from collectives_server.worker.models.inputs_expected import inputs_mismatch
from collectives_server.worker.models.registry import (
    GENERATOR,
    HostedModel,
    ModelRegistry,
    RetainedGraph,
)

__all__ = ["forward", "backward", "release", "run_on_devices"]


def run_on_devices(
    model: HostedModel, module: nn.Module, args: tuple, kwargs: dict, reads_only: bool = False
) -> Any:
    """``module(*args, **kwargs)`` over every local device of ``model`` when it has
    several GPUs: the one way a forward and a train_step run the model. A call that
    only reads the model (``reads_only``: no autograd, eval mode) runs on its kept
    copies (:mod:`device_replicas`); one that records a graph or runs in train mode
    through ``nn.parallel.data_parallel``, which copies the weights per call so that
    gradients and buffers reach the module's own."""
    devices = model.devices
    if reads_only and model.replicas is not None and not torch.is_grad_enabled():
        return model.replicas.run(module, args, kwargs)
    if len(devices) > 1 and all(d.type == "cuda" for d in devices):
        return nn.parallel.data_parallel(
            module,
            args,
            device_ids=[d.index for d in devices],
            output_device=devices[0].index,
            module_kwargs=kwargs,
        )
    return module(*args, **kwargs)


def _call(
    model: HostedModel,
    module: nn.Module,
    name: str,
    args: tuple,
    kwargs: dict,
    grad_enabled: bool,
    training: bool = False,
    keep_buffers: bool = False,
) -> Any:
    """The output of ``module`` (the model held at a version, in ``training`` mode) on
    these inputs. A train-mode call that fails leaves the model's buffers as they were,
    and so does one with ``keep_buffers`` (a shard run again whose statistics counted).

    Raises:
        InvalidArgument: the model failed on them.
    """
    drawing = GENERATOR.admitted() if training else contextlib.nullcontext()
    with torch.set_grad_enabled(grad_enabled):
        try:
            kept = model_modes.restoring_buffers(model.module, training, always=keep_buffers)
            with kept, drawing:
                reads_only = not grad_enabled and not training
                output = run_on_devices(model, module, args, kwargs, reads_only)
            if training and model.running_statistics:
                # This rank's running statistics moved with its own shard: the replicas
                # now answer differently (a forward placed by load runs again split).
                model.replicas_may_differ = True
            return output
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            raise InvalidArgument(
                inputs_mismatch(name, args, kwargs, module, model.module)
                or f"model {name!r} failed on these inputs: {backend_message(exc)}"
            ) from None


def _reads_only(
    model: HostedModel, request: worker_pb2.ForwardRequest, training: bool | None
) -> bool:
    """Whether this forward only reads the model (no autograd, eval mode): it may then
    run beside others (the model's lock held shared)."""
    return not request.grad_enabled and not bool(model.training if training is None else training)


def _mergeable(
    model: HostedModel,
    request: worker_pb2.ForwardRequest,
    training: bool | None,
    args: Any,
    kwargs: Any,
) -> tuple[int, tuple] | None:
    """(rows, company) when this forward may join a batch (``batching``): the model
    batches, autograd is off and the model runs in eval mode; else None."""
    if model.batcher is None or not _reads_only(model, request, training):
        return None
    return company_of(args, kwargs)


def _checked_output_names(request: worker_pb2.ForwardRequest) -> list[str]:
    """The names to store the outputs under (``apply``), checked; [] for a plain forward.

    Raises:
        InvalidArgument: a bad or repeated name, or names with autograd on.
    """
    names = list(request.output_names)
    if not names:
        return []
    if request.grad_enabled:
        raise InvalidArgument("output_names store the outputs: only without autograd")
    for name in names:
        validate_name(name, "output name")
        if reserved_prefix(name) is not None:
            raise InvalidArgument(f"output name {name!r} uses a reserved prefix")
    if len(set(names)) != len(names):
        raise InvalidArgument(f"output names repeat a name: {names}")
    return names


def forward(
    registry: ModelRegistry,
    store: TensorStore,
    request: worker_pb2.ForwardRequest,
    timeout_s: float,
    inline: dict[str, torch.Tensor] | None = None,
) -> worker_pb2.ForwardResponse:
    """Runs the model at the version the request names (``model_versions.serving``),
    waiting at most ``timeout_s`` for a version committed elsewhere but not yet here.

    ``inline``: the request's inline inputs by name (looked up before the store)."""
    started = time.perf_counter()
    model = registry.get(request.model, wait_s=timeout_s)  # a peer may still be sending it
    if request.load_id and request.load_id != model.load_id:
        raise FailedPrecondition(
            f"model {request.model!r} was loaded again (another load_model of the name) "
            "since this call was cut for it; read the model again and rerun",
            reason=Reason.MODEL_RELOADED,
        )
    registry.expire_graphs()
    call_id = request.call_id
    if not call_id:
        raise InvalidArgument("forward needs a call_id")
    wanted = list(request.input_grad_names)
    leaves: dict[str, torch.Tensor] = {}
    output_names = _checked_output_names(request)

    inline = inline or {}
    stored_inputs = False  # whether some input came from the store (deleted after use)
    finished = False

    device = model.devices[0]  # where the module's first replica lives

    def load(name: str) -> torch.Tensor:
        nonlocal stored_inputs
        t = inline.get(name)
        if t is None:
            t = store.get(name)
            stored_inputs = True
        if t.device != device:  # inline inputs arrive on the host; the module may not be
            t = t.to(device)
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
        deadline = time.monotonic() + timeout_s
        training = model_modes.training_of(request.mode)
        merged = _mergeable(model, request, training, args, kwargs)
        shared = _reads_only(model, request, training)
        used: dict[str, nn.Parameter] = {}  # a graph's parameters (merged runs keep none)
        if merged is not None:
            rows, company = merged
            output, version = model.batcher.run(
                args,
                (request.version, training, company),
                rows,
                lambda: model_versions.serving(
                    model, request.version, deadline, training, shared=True
                ),
                lambda module, inputs: _call(model, module, request.model, inputs, {}, False),
                deadline,
            )
        else:
            held = model_versions.serving(model, request.version, deadline, training, shared=shared)
            mode = bool(model.training if training is None else training)
            with held as (version, module):
                used = dict(model.parameters)  # the version's, as the graph holds them
                output = _call(
                    model,
                    module,
                    request.model,
                    args,
                    kwargs,
                    request.grad_enabled,
                    mode,
                    keep_buffers=request.statistics_counted,
                )
        stored: dict[str, torch.Tensor] = {}
        # Output leaves travel in the response, depth first, while they fit in the
        # bytes the caller allows; the rest (and every one after) wait in the store.
        inline_left = request.inline_output_bytes
        inlining = inline_left > 0 and not output_names

        def store_leaf(t: torch.Tensor) -> str | InlineLeaf:
            nonlocal inline_left, inlining
            name = f"{call_id}/out/{len(stored)}"
            stored[name] = t
            nbytes = t.numel() * t.element_size()
            if inlining and nbytes <= inline_left:
                inline_left -= nbytes
                return InlineLeaf(name, t)
            inlining = False
            store.put(name, t.detach())
            return name

        def name_leaf(t: torch.Tensor) -> str:
            if len(stored) == len(output_names):
                raise InvalidArgument(f"more tensors than the {len(output_names)} output names")
            name = output_names[len(stored)]
            stored[name] = t.detach()
            return name

        response = worker_pb2.ForwardResponse(
            replicas_may_differ=model.replicas_may_differ, load_id=model.load_id
        )
        try:
            fill_value(response.output, output, name_leaf if output_names else store_leaf)
        except InvalidArgument as exc:
            raise InvalidArgument(
                f"model {request.model!r} returned an output that cannot travel: {exc.message}"
            ) from None
        if output_names:
            if len(stored) != len(output_names):
                raise InvalidArgument(
                    f"model {request.model!r} returned {len(stored)} tensor(s) for "
                    f"{len(output_names)} output names"
                )
            store.put_many(stored)  # all or none, within the quota
        if request.grad_enabled and any(t.requires_grad for t in stored.values()):
            with model.lock:
                model.graphs[call_id] = RetainedGraph(
                    outputs=stored,
                    inputs={n: leaves[n] for n in wanted if n in leaves},
                    expires_at=time.monotonic() + registry.graph_ttl_s,
                    version=version,
                    parameters=used,
                )
        finished = True
    finally:
        # Inputs from the store go; a call whose inputs all came inline, and that
        # loaded them all, skips the scan of the store.
        if stored_inputs or not inline or not finished:
            store.delete_prefix(f"{call_id}/in/")
    response.version = version
    response.latency_s = time.perf_counter() - started
    return response


# What torch's autograd says of a saved tensor written in place after the forward.
_IN_PLACE_CHANGE = "modified by an inplace operation"


def backward(
    registry: ModelRegistry, store: TensorStore, request: worker_pb2.BackwardRequest
) -> worker_pb2.BackwardResponse:
    started = time.perf_counter()
    model = registry.get(request.model)
    with registry.backward_running():
        return _backward(registry, model, store, request, started)


def _backward(
    registry: ModelRegistry,
    model: HostedModel,
    store: TensorStore,
    request: worker_pb2.BackwardRequest,
    started: float,
) -> worker_pb2.BackwardResponse:
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
            # A drained rank hands its gradients over as they are once its store closes
            # (worker.drain_role, under this lock): none may accumulate after that.
            store.check_open()
            if tensors:
                # Gradients accumulate straight into the model's gradient arena, so
                # all_reduce_gradients reduces them in place (models.GradArena).
                arena = model.grad_arena()
                seeded = arena.seed()
                try:
                    torch.autograd.backward(tensors, grads)
                except RuntimeError as exc:
                    if _IN_PLACE_CHANGE not in str(exc):
                        raise
                    raise FailedPrecondition(
                        f"backward of call {call_id!r} of model {request.model!r}: a tensor "
                        "its forward saved was changed in place since (an optimizer step, "
                        "e.g. another client's step(), writes the weights in place); torch "
                        "refuses such a backward too. Run the forward again. "
                        f"({backend_message(exc)})"
                    ) from None
                finally:
                    arena.settle(seeded)
                if graph.version != model.version:  # a publish came since its forward
                    model_versions.carry_gradients(model, graph.parameters)
                # A data-parallel backward of a loss over the gathered batch: this
                # rank holds its shard's part of the batch's gradient.
                model.grads_are_shares = True
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
        released = model.graphs.pop(call_id, None) is not None
    if released:
        registry.graph_ended()
    return released
