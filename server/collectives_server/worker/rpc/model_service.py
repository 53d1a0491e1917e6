"""The model RPCs of the Worker service (loading, forward/backward, optimizer, state).

A part of :class:`~collectives_server.worker.rpc.service.WorkerService`: thin
translation between protobuf and :mod:`models` / :mod:`model_exec` /
:mod:`handlers.model_ops`. State dicts and gradients travel raw-framed like
PutTensor/GetTensor; the model name of LoadStateDict is request metadata.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import torch

from collectives.errors import CollectiveError, InvalidArgument, NotFound, Unavailable
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire import codec, pytree
from collectives.wire.batching import Batching
from collectives.wire.names import (
    BUILTIN_LOSSES,
    FUNCTION_PREFIX,
    MODEL_METADATA_KEY,
    validate_name,
)
from collectives.wire.op_specs import SPECS, OpKind
from collectives_server.json_input import parse_json_object
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.data.memory_release import drop_partial
from collectives_server.worker.data.store import UPLOAD_PREFIX
from collectives_server.worker.models import execution as model_exec
from collectives_server.worker.models import modes as model_modes
from collectives_server.worker.models import versions as model_versions
from collectives_server.worker.models.optimizers import (
    check_max_grad_norm,
    clip_gradients,
    install,
    plan_optimizer,
)
from collectives_server.worker.models.registry import (
    HostedModel,
    ModelDefinition,
    build_from_factory,
)
from collectives_server.worker.rpc.guards import counted as _counted
from collectives_server.worker.rpc.guards import guard as _guard
from collectives_server.worker.rpc.guards import guard_stream as _guard_stream
from collectives_server.worker.rpc.leader import Leader

__all__ = ["ModelRpcs"]


class ModelRpcs:
    """The model RPCs, over the worker's context; ops run through ``leader``."""

    def __init__(self, ctx: WorkerContext, leader: Leader) -> None:
        self._ctx = ctx
        self._leader = leader

    def _hosted(self, name: str, context) -> HostedModel:
        """The model ``name``; one a peer is still sending here (this worker joined the
        generation without it) is waited for, within the call's deadline."""
        remaining = context.time_remaining()
        wait_s = self._ctx.op_timeout_s if remaining is None else max(remaining, 0.0)
        return self._ctx.models.get(name, wait_s=min(wait_s, self._ctx.op_timeout_s))

    @_guard
    @_counted("load_model")
    def LoadModel(self, request_iterator, context) -> worker_pb2.LoadModelResponse:
        self._ctx.store.check_open()  # a drained rank: its models are handed over
        models, uploads = self._ctx.models, self._ctx.uploads
        with uploads.receive(request_iterator, self._ctx.store) as received:
            spec = received.spec
            batching = _batching(spec, models.factory_batching)
            if spec.factory:
                module = build_from_factory(
                    spec.factory,
                    spec.factory_kwargs_json,
                    models.allowed_factories,
                    max_bytes=uploads.config.max_bytes,
                )
                source = spec.factory
                definition = ModelDefinition(spec.factory, spec.factory_kwargs_json or "{}")
            else:
                if received.archive is None:
                    raise InvalidArgument("LoadModel carried neither a factory nor an archive")
                kept = uploads.kept_path()
                try:
                    module = uploads.load(received.archive, keep=kept)
                except BaseException:
                    kept.unlink(missing_ok=True)
                    raise
                source = "export"
                definition = ModelDefinition(archive=kept)
        hosted = models.add(
            spec.name,
            module,
            source,
            definition,
            batching=batching,
            training=model_modes.training_of(spec.mode),
            load_id=spec.load_id,
        )
        return worker_pb2.LoadModelResponse(model=_model_info(hosted))

    @_guard
    @_counted("unload_model")
    def UnloadModel(self, request, context) -> worker_pb2.UnloadModelResponse:
        self._ctx.store.check_open()  # a drained rank: its models are handed over
        validate_name(request.name, "model name")
        unloaded = self._ctx.models.remove(request.name)
        if not unloaded and not request.missing_ok:
            raise NotFound(f"model {request.name!r} is not loaded on this worker")
        return worker_pb2.UnloadModelResponse(unloaded=unloaded)

    @_guard
    @_counted("set_model_mode")
    def SetModelMode(self, request, context) -> worker_pb2.SetModelModeResponse:
        self._ctx.store.check_open()  # a drained rank: its models are handed over
        validate_name(request.name, "model name")
        if request.mode not in (worker_pb2.MODEL_MODE_TRAIN, worker_pb2.MODEL_MODE_EVAL):
            raise InvalidArgument("SetModelMode needs mode MODEL_MODE_TRAIN or MODEL_MODE_EVAL")
        model = self._hosted(request.name, context)
        model.set_mode(request.mode == worker_pb2.MODEL_MODE_TRAIN)  # builds (or refuses) it now
        return worker_pb2.SetModelModeResponse(model=_model_info(model))

    @_guard
    def ListModels(self, request, context) -> worker_pb2.ListModelsResponse:
        return worker_pb2.ListModelsResponse(
            models=[_model_info(m) for m in self._ctx.models.all()]
        )

    @_guard
    @_counted("forward")
    def Forward(self, request, context) -> worker_pb2.ForwardResponse:
        validate_name(request.model, "model name")
        validate_name(request.call_id, "call id")
        if request.grad_enabled:
            # A graph made on a drained rank could not move with it (its gradients do):
            # refused before it runs, so the client runs the call where the rank is now.
            try:
                self._ctx.store.check_open()
            except Unavailable as err:
                raise Unavailable(err.message, executed=False) from None
        admitted = time.monotonic()
        runtime = self._ctx.runtime
        slot = self._ctx.recorder.open_call(
            "forward",
            (request.model,),
            request.call_id,
            runtime.rank if runtime is not None else -1,
            runtime.generation if runtime is not None else 0,
            admitted,
            context.peer() if self._ctx.recorder.enabled else "",
        )
        seq = slot.seq if slot is not None else -1
        try:
            store = self._ctx.store
            inline = _inline_inputs(request.call_id, pytree.inline_leaves(request.args))
            inline.update(_inline_inputs(request.call_id, pytree.inline_leaves(request.kwargs)))
            left = context.time_remaining()
            wait_s = self._ctx.op_timeout_s if left is None else min(left, self._ctx.op_timeout_s)
            if slot is not None:
                slot.start_if_held(seq, time.monotonic())
            with self._ctx.forwards.running(request.model, request.routed) as load:
                response = model_exec.forward(self._ctx.models, store, request, wait_s, inline)
                response.forwards_in_flight = load.in_flight - 1
        except CollectiveError as exc:
            if slot is not None:
                slot.finish_if_held(seq, time.monotonic(), exc.code.value[0], exc.message)
            raise
        except BaseException:
            if slot is not None:
                internal = grpc.StatusCode.INTERNAL.value[0]
                slot.finish_if_held(seq, time.monotonic(), internal, "internal error")
            raise
        if slot is not None:
            slot.finish_if_held(seq, time.monotonic(), 0)
        return response

    @_guard
    @_counted("backward")
    def Backward(self, request, context) -> worker_pb2.BackwardResponse:
        self._ctx.store.check_open()  # a drained rank: its models are handed over
        validate_name(request.model, "model name")
        store = self._ctx.store
        _store_inline(store, request.call_id, list(request.inline_grads))
        response = model_exec.backward(self._ctx.models, store, request)
        budget = request.inline_output_bytes
        for name in response.input_grad_names:
            if not name:
                continue
            t = store.get(name)
            nbytes = t.numel() * t.element_size()
            if nbytes > budget:
                break
            budget -= nbytes
            response.inline_input_grads.add(name=name, tensor=codec.tensor_to_proto(t))
            store.delete_if_same(name, t)
        return response

    @_guard
    @_counted("release_graph")
    def ReleaseGraph(self, request, context) -> worker_pb2.ReleaseGraphResponse:
        validate_name(request.call_id, "call id")
        released = model_exec.release(
            self._ctx.models, self._ctx.store, request.model, request.call_id
        )
        return worker_pb2.ReleaseGraphResponse(released=released)

    @_guard
    @_counted("zero_grad")
    def ZeroGrad(self, request, context) -> worker_pb2.ZeroGradResponse:
        if request.HasField("options"):  # the leader's: one op of its order, every rank
            args = worker_pb2.ZeroGradRequest(model=request.model)
            result = self._model_op(context, OpKind.ZERO_GRAD, request.options, args)
            return worker_pb2.ZeroGradResponse(op_id=result.op_id)
        self._ctx.store.check_open()  # a drained rank: its models are handed over
        model = self._hosted(request.model, context)
        with model.lock:
            model.module.zero_grad(set_to_none=True)
            model.grads_are_shares = False
        return worker_pb2.ZeroGradResponse()

    @_guard
    @_counted("step")
    def Step(self, request, context) -> worker_pb2.StepResponse:
        hyper = _json_object(request.hyper_json, "optimizer hyperparameters")
        check_max_grad_norm(request.max_grad_norm)
        if request.HasField("options"):  # the leader's: one op of its order, every rank
            args = worker_pb2.StepRequest()
            args.CopyFrom(request)
            args.ClearField("options")
            result = self._model_op(context, OpKind.STEP, request.options, args)
            return worker_pb2.StepResponse(
                steps=result.steps,
                op_id=result.op_id,
                generation=result.generation,
                version=result.version,
            )
        # A client of the release before sends its step to each rank: run it here, now.
        self._ctx.store.check_open()  # a drained rank: its models are handed over
        model = self._hosted(request.model, context)
        with model.lock:
            optimizer = install(model, plan_optimizer(model, request.optimizer, hyper))
            clip_gradients(model, request.max_grad_norm)
            optimizer.step()
            model.steps += 1
            model.replicas_may_differ = True
            model_versions.bump(model)
            return worker_pb2.StepResponse(steps=model.steps)

    @_guard_stream
    @_counted("model_tensors")
    def GetModelTensors(self, request, context) -> Iterator[bytes]:
        model = self._hosted(request.model, context)
        with model.lock:
            if request.which == "gradients":
                tensors = {
                    n: p.grad.detach().clone()
                    for n, p in model.module.named_parameters()
                    if p.grad is not None
                }
            elif request.which == "state_dict":
                tensors = {n: t.detach().clone() for n, t in model.module.state_dict().items()}
            else:
                raise InvalidArgument(f"which={request.which!r}; use 'gradients' or 'state_dict'")
        for name, tensor in tensors.items():
            yield from codec.encode_tensor_stream(name, tensor)

    @_guard
    @_counted("load_state_dict")
    def LoadStateDict(self, request_iterator, context) -> worker_pb2.LoadStateDictResponse:
        self._ctx.store.check_open()  # a drained rank: its models are handed over
        metadata = dict(context.invocation_metadata())
        model = self._hosted(metadata.get(MODEL_METADATA_KEY, ""), context)
        try:
            received = codec.assemble_named_tensors(request_iterator, "LoadStateDict")
            with model.lock:
                _check_state_dict(model, received)
                model.module.load_state_dict(received)
                model_versions.bump(model)
        except BaseException as exc:
            # Refused or cut off: the tensors received so far go now, not with the
            # traceback gRPC keeps (this frame is in it) at a later full GC.
            received = None
            drop_partial(exc)
            raise
        return worker_pb2.LoadStateDictResponse(tensors=len(received))

    @_guard
    def PublishModel(self, r, context) -> worker_pb2.PublishModelResponse:
        validate_name(r.model, "model name")
        if not r.prefix.startswith(UPLOAD_PREFIX) or not r.prefix.endswith("/"):
            raise InvalidArgument(
                f"publish prefix {r.prefix[:64]!r} must look like '{UPLOAD_PREFIX}<id>/'"
            )
        validate_name(r.prefix + "x", "publish prefix")
        generation = self._leader.generation(r.options)
        uploads = self._ctx.store.under(r.prefix)
        if not uploads:
            raise NotFound(f"nothing was uploaded under {r.prefix!r} on this worker; put first")
        args = worker_pb2.PublishArgs(
            model=r.model, root=generation.rank, prefix=r.prefix, strict=r.strict, cast=r.cast
        )
        for name, t in uploads:
            args.entries.append(codec.make_header(name[len(r.prefix) :], t))
        result = self._model_op(context, OpKind.PUBLISH_MODEL, r.options, args)
        return worker_pb2.PublishModelResponse(
            op_id=result.op_id,
            generation=result.generation,
            version=result.version,
            tensors=result.tensors,
            bytes=result.nbytes,
            latency_s=result.latency_s,
        )

    def _model_op(self, context, kind: OpKind, options, args):
        validate_name(args.model, "model name")
        generation = self._leader.generation(options)
        desc = worker_pb2.OpDescriptor(kind=kind, timeout_s=options.timeout_s)
        getattr(desc, SPECS[kind].args).CopyFrom(args)
        return self._leader.run(context, generation, desc, options)

    @_guard
    def AllReduceGradients(self, r, context) -> worker_pb2.AllReduceGradientsResponse:
        op = ReduceOp.from_wire(r.op)
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise InvalidArgument(
                f"all_reduce_gradients takes op sum or avg, not {op.name.lower()}"
            )
        if r.bucket_bytes < 0:
            raise InvalidArgument("bucket_bytes must be positive (0: the 25 MiB default)")
        args = worker_pb2.GradientsArgs(model=r.model, op=r.op, bucket_bytes=r.bucket_bytes)
        result = self._model_op(context, OpKind.ALL_REDUCE_GRADIENTS, r.options, args)
        return worker_pb2.AllReduceGradientsResponse(
            op_id=result.op_id,
            generation=result.generation,
            buckets=result.buckets,
            bytes=result.nbytes,
            latency_s=result.latency_s,
        )

    @_guard
    def TrainStep(self, r, context) -> worker_pb2.TrainStepResponse:
        validate_name(r.inputs, "inputs tensor name")
        validate_name(r.targets, "targets tensor name")
        if r.loss not in BUILTIN_LOSSES and not r.loss.startswith(FUNCTION_PREFIX):
            raise InvalidArgument(
                f"loss {r.loss!r} is not supported; use one of {BUILTIN_LOSSES} or a loss "
                "program (train_step(loss=module_or_function) exports and loads one)"
            )
        check_max_grad_norm(r.max_grad_norm)
        if r.optimizer:
            _json_object(r.hyper_json, "optimizer hyperparameters")
        args = worker_pb2.TrainStepArgs(
            model=r.model,
            inputs=r.inputs,
            targets=r.targets,
            loss=r.loss,
            optimizer=r.optimizer,
            hyper_json=r.hyper_json,
            bucket_bytes=r.bucket_bytes,
            max_grad_norm=r.max_grad_norm,
        )
        result = self._model_op(context, OpKind.TRAIN_STEP, r.options, args)
        return worker_pb2.TrainStepResponse(
            op_id=result.op_id,
            generation=result.generation,
            loss=result.loss,
            rank_losses=result.rank_losses,
            buckets=result.buckets,
            latency_s=result.latency_s,
        )


def _json_object(text: str, what: str) -> dict:
    return parse_json_object(text, what)


def _batching(spec: worker_pb2.ModelSpec, factory_default: Batching | None) -> Batching | None:
    """The batching a model is loaded with: its spec's, else the worker's default for
    models built by a factory (``--factory-batching``), else none.

    Raises:
        InvalidArgument: the spec's policy is out of bounds.
    """
    if spec.HasField("batching"):
        return Batching.from_proto(spec.batching)
    return factory_default if spec.factory else None


def _model_info(model) -> worker_pb2.ModelInfo:
    params = [p for _, p in model.parameters]
    batching, stats = None, None
    if model.batcher is not None:
        batching = model.batcher.policy.to_proto()
        done = model.batcher.stats()
        stats = worker_pb2.BatchingStats(
            batches=done.batches, calls=done.calls, rows=done.rows, largest_rows=done.largest_rows
        )
    return worker_pb2.ModelInfo(
        batching=batching,
        batching_stats=stats,
        name=model.name,
        parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        devices=[str(d) for d in model.devices],
        source=model.source,
        optimizer=model.optimizer_kind,
        graphs_retained=len(model.graphs),
        steps=model.steps,
        version=model.version,
        training=bool(model.training),
        batch_statistics=model.batch_statistics,
        running_statistics=model.running_statistics,
        load_id=model.load_id,
    )


def _inline_inputs(call_id: str, tensors: list[worker_pb2.InlineTensor]) -> dict:
    """A call's inline tensors by name (which must lie under the call); they never
    enter the store."""
    found = {}
    for inline in tensors:
        validate_name(inline.name)
        if not inline.name.startswith(f"{call_id}/"):
            raise InvalidArgument(
                f"inline tensor {inline.name!r} must be named under its call {call_id!r}/"
            )
        try:
            found[inline.name] = codec.tensor_from_proto(inline.tensor)
        except InvalidArgument as exc:
            raise InvalidArgument(f"inline tensor {inline.name!r}: {exc.message}") from None
    return found


def _store_inline(store, call_id: str, tensors: list[worker_pb2.InlineTensor]) -> None:
    """Stores a call's inline tensors under their names, which must lie under the call."""
    for name, t in _inline_inputs(call_id, tensors).items():
        store.put(name, t)


def _check_state_dict(model: HostedModel, received: dict[str, torch.Tensor]) -> None:
    """INVALID_ARGUMENT unless ``received`` has exactly the model's keys and shapes."""
    current = model.module.state_dict()
    unknown = sorted(set(received) - set(current))
    missing = sorted(set(current) - set(received))
    if unknown or missing:
        raise InvalidArgument(
            f"state dict keys do not match model {model.name!r}: "
            f"unexpected {unknown[:5]}, missing {missing[:5]}"
        )
    for key, tensor in received.items():
        if tuple(tensor.shape) != tuple(current[key].shape):
            raise InvalidArgument(
                f"state dict entry {key!r} has shape {list(tensor.shape)}; "
                f"the model has {list(current[key].shape)}"
            )
