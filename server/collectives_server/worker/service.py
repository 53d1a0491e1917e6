"""The ``collectives.v1.Worker`` servicer: protobuf in, domain calls, protobuf out.

PutTensor and GetTensor are registered with identity (de)serializers: their
messages arrive and leave as raw bytes framed by :mod:`collectives.codec`, so
payloads are never copied through protobuf. Everything else uses the
generated message classes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import grpc
import torch
from google.protobuf import message_factory

from collectives.dtypes import to_wire
from collectives.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from collectives.names import validate_name
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire import codec
from collectives.wire.bulk_frames import BULK_MIN_BYTES, new_ticket
from collectives_server.rpc_limits import RpcLimits
from collectives_server.worker.bulk import BulkListener
from collectives_server.worker.group_cap import check_group_cap, subgroup_count
from collectives_server.worker.memory_release import drop_partial
from collectives_server.worker.model_service import ModelRpcs
from collectives_server.worker.rpc_guards import counted as _counted
from collectives_server.worker.rpc_guards import guard as _guard
from collectives_server.worker.rpc_guards import guard_stream as _guard_stream
from collectives_server.worker.shm_service import get_tensor_shm, put_tensor_shm

if TYPE_CHECKING:
    from collectives_server.worker.daemon import WorkerDaemon
    from collectives_server.worker.runtime import GenerationRuntime

__all__ = ["WorkerService", "add_worker_service", "SERVICE_NAME"]

log = logging.getLogger(__name__)
SERVICE_NAME = "collectives.v1.Worker"


class WorkerService(ModelRpcs):
    def __init__(self, daemon: WorkerDaemon) -> None:
        self._daemon = daemon

    # ------------------------------------------------------------ data plane
    @_guard
    @_counted("put")
    def PutTensor(self, request_iterator: Iterator[bytes], context) -> worker_pb2.PutTensorResponse:
        assembler: codec.TensorAssembler | None = None
        reservation = None
        try:
            for raw in request_iterator:
                kind, value = codec.decode_part(raw)
                if kind == "header":
                    if assembler is not None:
                        raise InvalidArgument("PutTensor stream carries a second header")
                    validate_name(value.name)
                    # Quota reserved before the assembler preallocates the buffer.
                    meta = codec.check_header(value)
                    reservation = self._daemon.store.reserve(meta.name, meta.nbytes, "put")
                    assembler = codec.TensorAssembler(value)
                elif kind == "chunk":
                    if assembler is None:
                        raise InvalidArgument("PutTensor stream must start with a header")
                    assembler.add(value)
            if assembler is None:
                raise InvalidArgument("PutTensor stream was empty: send a header, then chunks")
            tensor = assembler.finish()
        except BaseException as exc:
            # Cancelled or refused: free the partial buffer now (H3), not at a later GC.
            assembler = None
            if reservation is not None:
                reservation.release()
            drop_partial(exc if isinstance(exc, grpc.RpcError) else None)
            raise
        reservation.release()
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

    # ------------------------------------------------------ bulk data plane
    @_guard
    def GetDataPlane(self, request, context) -> worker_pb2.DataPlaneResponse:
        bulk = self._daemon.bulk
        return worker_pb2.DataPlaneResponse(
            bulk_port=bulk.port if bulk is not None else 0, bulk_min_bytes=BULK_MIN_BYTES
        )

    @_guard
    @_counted("put")
    def PutTensorBulk(
        self, request: worker_pb2.PutTensorBulkRequest, context
    ) -> worker_pb2.PutTensorResponse:
        bulk = self._bulk()
        try:
            validate_name(request.header.name)
            meta = codec.check_header(request.header)
            reservation = self._daemon.store.reserve(meta.name, meta.nbytes, "bulk put")
        except BaseException:
            bulk.refuse(request.ticket)
            raise
        try:
            buffer = _receive_buffer(meta.nbytes, self._daemon.store.device)
            bulk.receive(request.ticket, buffer, _remaining_s(context, self._daemon.op_timeout_s))
        except BaseException as exc:
            bulk.refuse(request.ticket)
            buffer = None
            drop_partial(exc if isinstance(exc, grpc.RpcError) else None)
            raise
        finally:
            reservation.release()
        self._daemon.store.put(meta.name, buffer.view(meta.dtype).reshape(meta.shape))
        self._daemon.stats.add_bytes(received=meta.nbytes)
        return worker_pb2.PutTensorResponse(name=meta.name, nbytes=meta.nbytes)

    @_guard
    @_counted("get")
    def GetTensorBulk(
        self, request: worker_pb2.GetTensorBulkRequest, context
    ) -> worker_pb2.GetTensorBulkResponse:
        bulk = self._bulk()
        validate_name(request.name)
        tensor = self._daemon.store.get(request.name)
        wire = _host_copy(tensor)
        header = codec.make_header(request.name, wire)
        response = worker_pb2.GetTensorBulkResponse(header=header)
        if header.nbytes < BULK_MIN_BYTES:
            response.inline_data = codec.tensor_memoryview(wire).tobytes()
        else:
            ticket = new_ticket()
            # The ticket's bytes count against the quota until sent or expired (M2).
            hold = self._daemon.store.reserve(f"{request.name} (bulk get)", header.nbytes, "get")
            remaining = _remaining_s(context, self._daemon.op_timeout_s)
            try:
                ttl = bulk.offer(ticket, wire, remaining, hold)
            except BaseException:
                hold.release()
                raise
            response.ticket = ticket
            response.ticket_ttl_s = ttl
        self._daemon.stats.add_bytes(sent=header.nbytes)
        if request.consume:
            self._daemon.store.delete_if_same(request.name, tensor)
        return response

    def _bulk(self) -> BulkListener:
        bulk = self._daemon.bulk
        if bulk is None:
            raise FailedPrecondition(
                "this worker has no bulk port (TLS is on, or it runs with --no-bulk): "
                "use PutTensor/GetTensor"
            )
        return bulk

    # ------------------------------------------------ same-host shared memory
    @_guard
    @_counted("put")
    def PutTensorShm(
        self, request: worker_pb2.PutTensorShmRequest, context
    ) -> worker_pb2.PutTensorResponse:
        return put_tensor_shm(self._daemon, request, context.peer() or "", self._daemon.port)

    @_guard
    @_counted("get")
    def GetTensorShm(
        self, request: worker_pb2.GetTensorShmRequest, context
    ) -> worker_pb2.GetTensorShmResponse:
        daemon = self._daemon
        return get_tensor_shm(
            daemon, daemon.shm_segments, request, context.peer() or "", daemon.port
        )

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
            check_group_cap(subgroup_count(runtime.groups), runtime.max_groups, runtime.generation)
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


def _receive_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Where a bulk put lands: pinned host memory for a CUDA store (its copy to
    the device is then a DMA at full bus speed), huge-page memory otherwise."""
    return codec.allocate_bytes(nbytes, pin_memory=device.type == "cuda")


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The wire layout of a stored tensor on the host; via pinned memory from a GPU."""
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.resolve_conj().resolve_neg())
        return host
    return codec.wire_tensor(tensor)


def _remaining_s(context, default_s: float) -> float:
    """The call's time left (its deadline), or ``default_s`` when it has none."""
    remaining = context.time_remaining()
    # Never beyond the longest any call may run (--max-rpc-s), whatever the client asked.
    return default_s if remaining is None else max(min(remaining, _MAX_WAIT_S), 0.0)


_MAX_WAIT_S = RpcLimits().max_rpc_s

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
