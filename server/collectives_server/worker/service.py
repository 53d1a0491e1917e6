"""The ``collectives.v1.Worker`` servicer: protobuf in, domain calls, protobuf out.

PutTensor and GetTensor are registered with identity (de)serializers: their
messages arrive and leave as raw bytes framed by :mod:`collectives.codec`, so
payloads are never copied through protobuf. Everything else uses the
generated message classes.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import grpc
from google.protobuf import message_factory

from collectives import codec
from collectives.dtypes import to_wire
from collectives.errors import (
    EXECUTED_METADATA_KEY,
    CollectiveError,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from collectives.names import validate_name
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives_server.worker import model_exec
from collectives_server.worker.models import build_from_factory, load_exported, make_optimizer
from collectives_server.worker.status import data_op_done

if TYPE_CHECKING:
    from collectives_server.worker.daemon import WorkerDaemon
    from collectives_server.worker.runtime import GenerationRuntime

__all__ = ["WorkerService", "add_worker_service", "SERVICE_NAME"]

log = logging.getLogger(__name__)
SERVICE_NAME = "collectives.v1.Worker"


def _abort(context: grpc.ServicerContext, err: CollectiveError) -> None:
    if err.executed is False:
        context.set_trailing_metadata(((EXECUTED_METADATA_KEY, "no"),))
    context.abort(err.code, err.message)


def _guard(method):
    """Turns SDK-style errors into gRPC statuses; unexpected ones into INTERNAL."""

    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except CollectiveError as err:
            _abort(context, err)
        except Exception as exc:
            if isinstance(exc, grpc.RpcError) or type(exc).__name__ == "_AbortError":
                raise
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")

    wrapper.__name__ = method.__name__
    return wrapper


def _guard_stream(method):
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except CollectiveError as err:
            _abort(context, err)

    wrapper.__name__ = method.__name__
    return wrapper


def _subject(request: object) -> str:
    """The tensor or model a request is about, for op records and logs."""
    return getattr(request, "name", "") or getattr(request, "model", "")


def _counted(kind: str):
    """Counts a data-plane call in the worker's status and metrics: outcome and latency."""

    def decorate(method):
        def unary(self, request, context):
            started, code, message, name = time.perf_counter(), None, "", ""
            try:
                response = method(self, request, context)
                name = getattr(response, "name", "")
                return response
            except CollectiveError as err:
                code, message = err.code, err.message
                raise
            except Exception as exc:
                code, message = grpc.StatusCode.INTERNAL, str(exc)
                raise
            finally:
                name = name or _subject(request)
                data_op_done(self._daemon, kind, name, code, message, time.perf_counter() - started)

        def stream(self, request, context):
            started, code, message = time.perf_counter(), None, ""
            try:
                yield from method(self, request, context)
            except CollectiveError as err:
                code, message = err.code, err.message
                raise
            except GeneratorExit:
                code, message = grpc.StatusCode.CANCELLED, "the client cancelled the stream"
                raise
            except Exception as exc:
                code, message = grpc.StatusCode.INTERNAL, str(exc)
                raise
            finally:
                latency_s = time.perf_counter() - started
                data_op_done(self._daemon, kind, _subject(request), code, message, latency_s)

        wrapper = stream if inspect.isgeneratorfunction(method) else unary
        wrapper.__name__ = method.__name__
        return wrapper

    return decorate


class WorkerService:
    def __init__(self, daemon: WorkerDaemon) -> None:
        self._daemon = daemon

    # ------------------------------------------------------------ data plane
    @_guard
    @_counted("put")
    def PutTensor(self, request_iterator: Iterator[bytes], context) -> worker_pb2.PutTensorResponse:
        assembler: codec.TensorAssembler | None = None
        for raw in request_iterator:
            kind, value = codec.decode_part(raw)
            if kind == "header":
                if assembler is not None:
                    raise InvalidArgument("PutTensor stream carries a second header")
                validate_name(value.name)
                assembler = codec.TensorAssembler(value)
                self._daemon.store.check_quota(value.name, assembler.meta.nbytes)
            elif kind == "chunk":
                if assembler is None:
                    raise InvalidArgument("PutTensor stream must start with a header")
                assembler.add(value)
        if assembler is None:
            raise InvalidArgument("PutTensor stream was empty: send a header, then chunks")
        tensor = assembler.finish()
        self._daemon.store.put(assembler.name, tensor)
        self._daemon.stats.add_bytes(received=assembler.meta.nbytes)
        return worker_pb2.PutTensorResponse(name=assembler.name, nbytes=assembler.meta.nbytes)

    @_guard_stream
    @_counted("get")
    def GetTensor(self, request: worker_pb2.GetTensorRequest, context) -> Iterator[bytes]:
        validate_name(request.name)
        tensor = self._daemon.store.get(request.name)
        nbytes = tensor.numel() * tensor.element_size()
        yield from codec.encode_tensor_stream(request.name, tensor)
        self._daemon.stats.add_bytes(sent=nbytes)
        if request.consume:
            self._daemon.store.delete_if_same(request.name, tensor)

    @_guard
    @_counted("delete")
    def DeleteTensor(self, request, context) -> worker_pb2.DeleteTensorResponse:
        validate_name(request.name)
        deleted = self._daemon.store.delete(request.name)
        if not deleted and not request.missing_ok:
            raise NotFound(f"tensor {request.name!r} is not stored on this worker")
        return worker_pb2.DeleteTensorResponse(deleted=deleted)

    @_guard
    def ListTensors(self, request, context) -> worker_pb2.ListTensorsResponse:
        return worker_pb2.ListTensorsResponse(
            tensors=[
                worker_pb2.TensorInfo(
                    name=i.name,
                    dtype=to_wire(i.dtype),
                    shape=list(i.shape),
                    nbytes=i.nbytes,
                    device=i.device,
                )
                for i in self._daemon.store.infos()
            ]
        )

    @_guard
    def GetState(self, request, context) -> worker_pb2.GetStateResponse:
        return self._daemon.state()

    # ----------------------------------------------------------- collectives
    def _leader(self, options: worker_pb2.OpOptions) -> GenerationRuntime:
        runtime = self._daemon.runtime
        if runtime is None:
            raise Unavailable(
                f"the cluster is not formed ({self._daemon.cluster_status}); retry once it is",
                executed=False,
            )
        if options.generation and options.generation != runtime.generation:
            raise Unavailable(
                f"generation changed: the request was for generation {options.generation}, "
                f"the cluster is at {runtime.generation}; refresh the cluster and retry",
                executed=False,
            )
        if not runtime.is_leader:
            raise Unavailable(
                f"this worker is rank {runtime.rank} of generation {runtime.generation}, not the "
                f"leader (rank 0 at {self._daemon.leader_address or 'unknown'}); "
                "send collectives to the leader",
                executed=False,
            )
        return runtime

    def _run(
        self,
        context: grpc.ServicerContext,
        kind: str,
        options: worker_pb2.OpOptions,
        *,
        name: str = "",
        out: str = "",
        op: int = 0,
        root: int = 0,
        group_ranks: list[int] | None = None,
    ) -> worker_pb2.CollectiveResponse | worker_pb2.NewGroupResponse:
        if kind not in ("barrier", "new_group"):
            validate_name(name)
        if out:
            validate_name(out, "out name")
        ReduceOp.from_wire(op)
        runtime = self._leader(options)
        desc = worker_pb2.OpDescriptor(
            kind=kind, name=name, out=out, op=op, root=root, timeout_s=options.timeout_s
        )
        if kind == "new_group":
            ranks = list(group_ranks or [])
            if not ranks:
                raise InvalidArgument("new_group needs at least one rank")
            if len(set(ranks)) != len(ranks):
                raise InvalidArgument(f"new_group ranks {ranks} contain duplicates")
            bad = [r for r in ranks if not 0 <= r < runtime.world_size]
            if bad:
                raise InvalidArgument(
                    f"new_group ranks {bad} are out of range: world size is {runtime.world_size} "
                    f"(valid ranks 0..{runtime.world_size - 1})"
                )
            desc.group_id = runtime.allocate_group_id()
            desc.group_ranks.extend(sorted(ranks))
        else:
            group = runtime.groups.get(options.group_id)
            if group is None:
                raise NotFound(
                    f"group {options.group_id} does not exist in generation {runtime.generation}; "
                    "groups last as long as the generation they were made in: create it again"
                )
            desc.group_id = group.group_id
            if kind in ("broadcast", "reduce", "gather"):
                role = "src" if kind == "broadcast" else "dst"
                if not 0 <= root < runtime.world_size:
                    raise InvalidArgument(
                        f"{role} rank {root} is out of range: world size is {runtime.world_size} "
                        f"(valid ranks 0..{runtime.world_size - 1})"
                    )
                if root not in group.ranks:
                    raise InvalidArgument(
                        f"{role} rank {root} is not a member of group {group.group_id} "
                        f"(ranks {group.ranks}); {role} is a global rank"
                    )
        result = self._wait(context, runtime, desc, options)
        if kind == "new_group":
            return worker_pb2.NewGroupResponse(
                group_id=desc.group_id, generation=result.generation, ranks=result.result_ranks
            )
        return worker_pb2.CollectiveResponse(
            op_id=result.op_id,
            generation=result.generation,
            result_name=result.result_name,
            result_ranks=result.result_ranks,
            dtype=to_wire(result.dtype) if result.dtype is not None else 0,
            shape=list(result.shape),
            latency_s=result.latency_s,
        )

    def _wait(self, context, runtime: GenerationRuntime, desc, options):
        """Queues ``desc`` on the leader and waits within the call's deadline."""
        kind = desc.kind
        pending = runtime.submit(desc)
        budget = self._daemon.op_timeout_s * 2
        for limit in (context.time_remaining(), options.timeout_s or None):
            if limit is not None:
                budget = min(budget, limit)
        try:
            result = pending.future.result(timeout=max(budget, 0.0))
        except FutureTimeout:
            if runtime.cancel(pending):
                raise DeadlineExceeded(
                    f"op {desc.op_id} ({kind}) did not start within {budget:.1f}s "
                    f"(queue depth {runtime.queue_depth}); it was dropped",
                    executed=False,
                ) from None
            raise DeadlineExceeded(
                f"op {desc.op_id} ({kind}) still running after {budget:.1f}s; it may still complete"
            ) from None
        return result

    @_guard
    def Broadcast(self, r, context):
        return self._run(context, "broadcast", r.options, name=r.name, root=r.src)

    @_guard
    def AllReduce(self, r, context):
        return self._run(context, "all_reduce", r.options, name=r.name, out=r.out, op=r.op)

    @_guard
    def Reduce(self, r, context):
        return self._run(context, "reduce", r.options, name=r.name, out=r.out, op=r.op, root=r.dst)

    @_guard
    def AllGather(self, r, context):
        return self._run(context, "all_gather", r.options, name=r.name, out=r.out)

    @_guard
    def Gather(self, r, context):
        return self._run(context, "gather", r.options, name=r.name, out=r.out, root=r.dst)

    @_guard
    def ReduceScatter(self, r, context):
        return self._run(context, "reduce_scatter", r.options, name=r.name, out=r.out, op=r.op)

    @_guard
    def AllToAll(self, r, context):
        return self._run(context, "all_to_all", r.options, name=r.name, out=r.out)

    @_guard
    def Barrier(self, r, context):
        return self._run(context, "barrier", r.options)

    @_guard
    def NewGroup(self, r, context):
        return self._run(context, "new_group", r.options, group_ranks=list(r.ranks))

    # ----------------------------------------------------------------- models
    @_guard
    @_counted("load_model")
    def LoadModel(self, request_iterator, context) -> worker_pb2.LoadModelResponse:
        spec = None
        archive = bytearray()
        for part in request_iterator:
            which = part.WhichOneof("part")
            if which == "spec":
                if spec is not None:
                    raise InvalidArgument("LoadModel stream carries a second spec")
                spec = part.spec
                validate_name(spec.name, "model name")
                if spec.archive_nbytes > codec.MAX_TENSOR_BYTES:
                    raise InvalidArgument(
                        f"model archive of {spec.archive_nbytes} bytes is too large"
                    )
            elif which == "archive_chunk":
                if spec is None:
                    raise InvalidArgument("LoadModel stream must start with a spec")
                archive += part.archive_chunk
                if len(archive) > spec.archive_nbytes:
                    raise InvalidArgument("model archive is longer than its declared size")
        if spec is None:
            raise InvalidArgument("LoadModel stream was empty: send a spec first")
        models = self._daemon.models
        if spec.factory:
            if archive:
                raise InvalidArgument("send either a factory or an archive, not both")
            module = build_from_factory(
                spec.factory, spec.factory_kwargs_json, models.allowed_factories
            )
            source = spec.factory
        else:
            if len(archive) != spec.archive_nbytes:
                raise InvalidArgument(
                    f"model archive ended after {len(archive)} of {spec.archive_nbytes} bytes"
                )
            module = load_exported(bytes(archive))
            source = "export"
        hosted = models.add(spec.name, module, source)
        return worker_pb2.LoadModelResponse(model=_model_info(hosted))

    @_guard
    @_counted("unload_model")
    def UnloadModel(self, request, context) -> worker_pb2.UnloadModelResponse:
        validate_name(request.name, "model name")
        unloaded = self._daemon.models.remove(request.name)
        if not unloaded and not request.missing_ok:
            raise NotFound(f"model {request.name!r} is not loaded on this worker")
        return worker_pb2.UnloadModelResponse(unloaded=unloaded)

    @_guard
    def ListModels(self, request, context) -> worker_pb2.ListModelsResponse:
        return worker_pb2.ListModelsResponse(
            models=[_model_info(m) for m in self._daemon.models.all()]
        )

    @_guard
    @_counted("forward")
    def Forward(self, request, context) -> worker_pb2.ForwardResponse:
        validate_name(request.model, "model name")
        validate_name(request.call_id, "call id")
        return model_exec.forward(self._daemon.models, self._daemon.store, request)

    @_guard
    @_counted("backward")
    def Backward(self, request, context) -> worker_pb2.BackwardResponse:
        validate_name(request.model, "model name")
        return model_exec.backward(self._daemon.models, self._daemon.store, request)

    @_guard
    @_counted("release_graph")
    def ReleaseGraph(self, request, context) -> worker_pb2.ReleaseGraphResponse:
        validate_name(request.call_id, "call id")
        released = model_exec.release(
            self._daemon.models, self._daemon.store, request.model, request.call_id
        )
        return worker_pb2.ReleaseGraphResponse(released=released)

    @_guard
    @_counted("zero_grad")
    def ZeroGrad(self, request, context) -> worker_pb2.ZeroGradResponse:
        model = self._daemon.models.get(request.model)
        with model.lock:
            model.module.zero_grad(set_to_none=True)
        return worker_pb2.ZeroGradResponse()

    @_guard
    @_counted("step")
    def Step(self, request, context) -> worker_pb2.StepResponse:
        model = self._daemon.models.get(request.model)
        hyper = _json_object(request.hyper_json, "optimizer hyperparameters")
        with model.lock:
            if (
                model.optimizer is None
                or model.optimizer_kind != request.optimizer
                or model.optimizer_hyper != hyper
            ):
                optimizer = make_optimizer(model, request.optimizer, hyper)
                if model.optimizer is not None and model.optimizer_kind == request.optimizer:
                    # Same optimizer, new hyperparameters: keep its state (momentum, moments).
                    optimizer.load_state_dict(model.optimizer.state_dict())
                    for group in optimizer.param_groups:
                        group.update(hyper)
                model.optimizer, model.optimizer_kind, model.optimizer_hyper = (
                    optimizer,
                    request.optimizer,
                    hyper,
                )
            model.optimizer.step()
            model.steps += 1
            return worker_pb2.StepResponse(steps=model.steps)

    @_guard_stream
    @_counted("model_tensors")
    def GetModelTensors(self, request, context) -> Iterator[bytes]:
        model = self._daemon.models.get(request.model)
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
        metadata = dict(context.invocation_metadata())
        model = self._daemon.models.get(metadata.get(MODEL_METADATA_KEY, ""))
        received: dict[str, object] = {}
        assembler: codec.TensorAssembler | None = None
        for raw in request_iterator:
            kind, value = codec.decode_part(raw)
            if kind == "header":
                if assembler is not None:
                    received[assembler.name] = assembler.finish()
                assembler = codec.TensorAssembler(value)
            elif kind == "chunk":
                if assembler is None:
                    raise InvalidArgument("LoadStateDict stream must start with a header")
                assembler.add(value)
        if assembler is not None:
            received[assembler.name] = assembler.finish()
        with model.lock:
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
            model.module.load_state_dict(received)
        return worker_pb2.LoadStateDictResponse(tensors=len(received))

    def _model_op(self, context, kind: str, options, **fields):
        validate_name(fields["name"], "model name")
        runtime = self._leader(options)
        desc = worker_pb2.OpDescriptor(kind=kind, timeout_s=options.timeout_s, **fields)
        return self._wait(context, runtime, desc, options)

    @_guard
    def AllReduceGradients(self, r, context) -> worker_pb2.AllReduceGradientsResponse:
        op = ReduceOp.from_wire(r.op)
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise InvalidArgument(
                f"all_reduce_gradients takes op sum or avg, not {op.name.lower()}"
            )
        if r.bucket_bytes < 0:
            raise InvalidArgument("bucket_bytes must be positive (0: the 25 MiB default)")
        result = self._model_op(
            context,
            "all_reduce_gradients",
            r.options,
            name=r.model,
            op=r.op,
            bucket_bytes=r.bucket_bytes,
        )
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
        if r.loss not in ("mse", "cross_entropy"):
            raise InvalidArgument(f"loss {r.loss!r} is not supported; use 'mse' or 'cross_entropy'")
        if r.optimizer:
            _json_object(r.hyper_json, "optimizer hyperparameters")
        result = self._model_op(
            context,
            "train_step",
            r.options,
            name=r.model,
            inputs=r.inputs,
            targets=r.targets,
            loss=r.loss,
            optimizer=r.optimizer,
            hyper_json=r.hyper_json,
            bucket_bytes=r.bucket_bytes,
        )
        return worker_pb2.TrainStepResponse(
            op_id=result.op_id,
            generation=result.generation,
            loss=result.loss,
            rank_losses=result.rank_losses,
            buckets=result.buckets,
            latency_s=result.latency_s,
        )


def _json_object(text: str, what: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{what} are not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    return value


def _model_info(model) -> worker_pb2.ModelInfo:
    params = [p for _, p in model.parameters]
    return worker_pb2.ModelInfo(
        name=model.name,
        parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        devices=[str(d) for d in model.devices],
        source=model.source,
        optimizer=model.optimizer_kind,
        graphs_retained=len(model.graphs),
        steps=model.steps,
    )


MODEL_METADATA_KEY = "collectives-model"
_RAW_REQUEST = {"PutTensor", "LoadStateDict"}
_RAW_RESPONSE = {"GetTensor", "GetModelTensors"}


def add_worker_service(servicer: WorkerService, server: grpc.Server) -> None:
    """Registers every Worker method; the data-plane ones with identity serializers."""
    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        deserializer = None if method.name in _RAW_REQUEST else request_cls.FromString
        serializer = None if method.name in _RAW_RESPONSE else response_cls.SerializeToString
        behaviour = getattr(servicer, method.name, None)
        if behaviour is None:  # not implemented by this server version: UNIMPLEMENTED
            continue
        if method.client_streaming and not method.server_streaming:
            make = grpc.stream_unary_rpc_method_handler
        elif method.server_streaming and not method.client_streaming:
            make = grpc.unary_stream_rpc_method_handler
        elif method.client_streaming:
            make = grpc.stream_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            behaviour, request_deserializer=deserializer, response_serializer=serializer
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
