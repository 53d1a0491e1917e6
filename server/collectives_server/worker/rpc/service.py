"""The ``collectives.v1.Worker`` servicer: protobuf in, domain calls, protobuf out.

PutTensor and GetTensor are registered with identity (de)serializers: their
messages arrive and leave as raw bytes framed by :mod:`collectives.wire.codec`, so
payloads are never copied through protobuf. Everything else uses the
generated message classes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch
from google.protobuf import message_factory

from collectives.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from collectives.reduce_ops import ReduceOp
from collectives.v1 import flight_record_pb2, worker_pb2
from collectives.wire import codec, op_args
from collectives.wire.dtypes import to_wire
from collectives.wire.limits import BULK_MIN_BYTES
from collectives.wire.names import validate_name
from collectives.wire.op_specs import (
    SPECS,
    Operand,
    OpKind,
    check_group_ranks,
    check_root,
)
from collectives_server.rpc.limits import RpcLimits
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.data.memory_release import drop_partial
from collectives_server.worker.data.store import result_of
from collectives_server.worker.engine.process_groups import check_group_cap, subgroup_count
from collectives_server.worker.rpc.bulk_answers import tensor_answer
from collectives_server.worker.rpc.guards import counted as _counted
from collectives_server.worker.rpc.guards import departure
from collectives_server.worker.rpc.guards import guard as _guard
from collectives_server.worker.rpc.guards import guard_stream as _guard_stream
from collectives_server.worker.rpc.handoff_service import HandoffRpcs
from collectives_server.worker.rpc.leader import Leader, collective_response, group_of
from collectives_server.worker.rpc.model_service import ModelRpcs
from collectives_server.worker.rpc.p2p_service import PeerRpcs
from collectives_server.worker.rpc.shm_service import get_tensor_shm, put_tensor_shm
from collectives_server.worker.status import worker_state
from collectives_server.worker.telemetry.flight_record import flight_record_response
from collectives_server.worker.transport.bulk import BulkListener

__all__ = ["WorkerService", "add_worker_service", "SERVICE_NAME"]

log = logging.getLogger(__name__)
SERVICE_NAME = "collectives.v1.Worker"


class WorkerService:
    """The Worker service in four parts, each taking the worker's context (and its
    :class:`Leader`): this class (data plane, collectives, groups, state), the
    model RPCs (:class:`ModelRpcs`), the point-to-point ones (:class:`PeerRpcs`)
    and a drain's handoff (:class:`HandoffRpcs`).
    :meth:`rpc` finds a method in whichever part has it."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._leader = Leader(ctx)
        self.models = ModelRpcs(ctx, self._leader)
        self.peers = PeerRpcs(ctx, self._leader)
        self.handoff = HandoffRpcs(ctx)

    def rpc(self, name: str) -> Callable[..., Any] | None:
        """The method serving the Worker RPC ``name`` (None: not implemented here)."""
        for part in (self, self.models, self.peers, self.handoff):
            method = getattr(part, name, None)
            if method is not None:
                return method
        return None

    # ------------------------------------------------------------ data plane
    @_guard
    @_counted("put")
    def PutTensor(self, request_iterator: Iterator[bytes], context) -> worker_pb2.PutTensorResponse:
        assembler: codec.TensorAssembler | None = None
        reservation = None
        name = ""  # known once the header arrived: a put that breaks off is named
        try:
            for raw in request_iterator:
                kind, value = codec.decode_part(raw)
                if kind == "header":
                    if assembler is not None:
                        raise InvalidArgument("PutTensor stream carries a second header")
                    validate_name(value.name)
                    name = value.name
                    # Quota reserved before the assembler preallocates the buffer.
                    meta = codec.check_header(value)
                    reservation = self._ctx.store.reserve(meta.name, meta.nbytes, "put")
                    assembler = codec.TensorAssembler(value, self._receive_buffer)
                elif kind == "chunk":
                    if assembler is None:
                        raise InvalidArgument("PutTensor stream must start with a header")
                    assembler.add(value)
            if assembler is None:
                raise InvalidArgument("PutTensor stream was empty: send a header, then chunks")
            tensor = assembler.finish()
        except BaseException as exc:
            # Cancelled or refused: free the partial buffer now, not at a later GC
            # (memory_release says why it could otherwise outlive the call). This
            # frame stays in the traceback gRPC keeps: it must not hold the last chunk.
            assembler = raw = value = None
            if reservation is not None:
                reservation.release()
            drop_partial(exc)
            gone = departure(context, name) if isinstance(exc, Exception) else None
            if gone is not None:  # the client went: not its data's fault, nor ours
                raise gone from exc
            raise
        reservation.release()
        self._store(assembler.name, tensor)
        self._ctx.stats.add_bytes(received=assembler.meta.nbytes)
        return worker_pb2.PutTensorResponse(name=assembler.name, nbytes=assembler.meta.nbytes)

    @_guard_stream
    @_counted("get")
    def GetTensor(self, request: worker_pb2.GetTensorRequest, context) -> Iterator[bytes]:
        validate_name(request.name)
        tensor = self._ctx.store.get(request.name, result_of(request))
        nbytes = tensor.numel() * tensor.element_size()
        yield from codec.encode_tensor_stream(request.name, tensor)
        self._ctx.stats.add_bytes(sent=nbytes)
        if request.consume:
            self._ctx.store.delete_if_same(request.name, tensor)

    # ------------------------------------------------------ bulk data plane
    @_guard
    def GetDataPlane(self, request, context) -> worker_pb2.DataPlaneResponse:
        bulk = self._ctx.bulk
        lanes = bulk.lanes if bulk is not None else None
        ticket = (
            lanes.issue(context.peer(), context.invocation_metadata())
            if request.open_lane and lanes is not None
            else b""
        )
        return worker_pb2.DataPlaneResponse(
            bulk_port=bulk.port if bulk is not None else 0,
            bulk_min_bytes=BULK_MIN_BYTES,
            lane_ticket=ticket,
            lane_methods=lanes.methods if ticket and lanes is not None else (),
            bulk_tls=bulk is not None and bulk.tls is not None,
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
            reservation = self._ctx.store.reserve(meta.name, meta.nbytes, "bulk put")
        except BaseException:
            bulk.refuse(request.ticket)
            raise
        try:
            buffer = self._receive_buffer(meta.nbytes)
            bulk.receive(request.ticket, buffer, _remaining_s(context, self._ctx.op_timeout_s))
        except BaseException as exc:
            bulk.refuse(request.ticket)
            buffer = None
            drop_partial(exc)
            raise
        finally:
            reservation.release()
        tensor = codec.typed(buffer, meta)
        del buffer  # the stored tensor alone holds the memory (see replaced_memory.py)
        self._store(meta.name, tensor)
        self._ctx.stats.add_bytes(received=meta.nbytes)
        return worker_pb2.PutTensorResponse(name=meta.name, nbytes=meta.nbytes)

    @_guard
    @_counted("get")
    def GetTensorBulk(
        self, request: worker_pb2.GetTensorBulkRequest, context
    ) -> worker_pb2.GetTensorBulkResponse:
        bulk = self._bulk()
        validate_name(request.name)
        tensor = self._ctx.store.get(request.name, result_of(request))
        remaining = _remaining_s(context, self._ctx.op_timeout_s)
        response = tensor_answer(request.name, tensor, self._ctx.store, bulk, remaining)
        header = response.header
        self._ctx.stats.add_bytes(sent=header.nbytes)
        if request.consume:
            self._ctx.store.delete_if_same(request.name, tensor)
        return response

    def _receive_buffer(self, nbytes: int) -> torch.Tensor:
        """Where a put lands: memory a put of the same size just replaced (no fresh
        pages to fault in), else a new buffer: pinned host memory for a CUDA store
        (its copy to the device is then a DMA at full bus speed)."""
        if self._ctx.store.device.type == "cuda":
            return codec.allocate_bytes(nbytes, pin_memory=True)
        kept = self._ctx.replaced.take(nbytes)
        return kept if kept is not None else codec.allocate_bytes(nbytes)

    def _store(self, name: str, tensor: torch.Tensor) -> None:
        """Stores a received put; the memory of the value it replaced is kept for reuse."""
        old = self._ctx.store.put(name, tensor)
        if old is not None:
            self._ctx.replaced.offer(old)

    def _bulk(self) -> BulkListener:
        bulk = self._ctx.bulk
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
        return put_tensor_shm(self._ctx, request, context.peer() or "")

    @_guard
    @_counted("get")
    def GetTensorShm(
        self, request: worker_pb2.GetTensorShmRequest, context
    ) -> worker_pb2.GetTensorShmResponse:
        return get_tensor_shm(self._ctx, request, context.peer() or "")

    @_guard
    @_counted("delete")
    def DeleteTensor(self, request, context) -> worker_pb2.DeleteTensorResponse:
        validate_name(request.name)
        deleted = self._ctx.store.delete(request.name)
        if not deleted and not request.missing_ok:
            raise NotFound(f"tensor {request.name!r} is not stored on this worker")
        return worker_pb2.DeleteTensorResponse(deleted=deleted)

    @_guard
    def ListTensors(self, request, context) -> worker_pb2.ListTensorsResponse:
        wanted = set(request.names)
        return worker_pb2.ListTensorsResponse(
            tensors=[
                worker_pb2.TensorInfo(
                    name=i.name,
                    dtype=to_wire(i.dtype),
                    shape=list(i.shape),
                    nbytes=i.nbytes,
                    device=i.device,
                )
                for i in self._ctx.store.infos()
                if not wanted or i.name in wanted
            ]
        )

    @_guard
    def GetState(self, request, context) -> worker_pb2.GetStateResponse:
        return worker_state(self._ctx)

    @_guard
    def GetFlightRecord(self, request, context) -> flight_record_pb2.FlightRecordResponse:
        return flight_record_response(self._ctx, request.last, request.before_seq)

    # ----------------------------------------------------------- collectives
    def _collective(
        self, context, kind: OpKind, options: worker_pb2.OpOptions, args: worker_pb2.TensorOpArgs
    ) -> worker_pb2.CollectiveResponse:
        op = SPECS[kind]
        if op.operand is not Operand.NONE:
            validate_name(args.name)
        if args.out:
            validate_name(args.out, "out name")
        ReduceOp.from_wire(args.op)
        generation = self._leader.generation(options)
        group = group_of(generation, options.group_id)
        if op.root_role:
            members = None if group.group_id == 0 else group.ranks
            check_root(op, args.root, generation.world_size, members)
        desc = worker_pb2.OpDescriptor(
            kind=kind, group_id=group.group_id, timeout_s=options.timeout_s, tensor=args
        )
        result = self._leader.run(context, generation, desc, options)
        return collective_response(result)

    def _coalesced(
        self, context, kind: OpKind, r, outs: list[str] | None = None, op: int = 0, root: int = 0
    ) -> worker_pb2.CollectiveResponse:
        """A coalesced op on ``r.names`` (``r.name`` must be empty): one atomic op."""
        if r.name or getattr(r, "out", ""):
            raise InvalidArgument("give either name (and out) or names (and outs), not both")
        names, outs = op_args.check_coalesced_names(list(r.names), outs or None)
        ReduceOp.from_wire(op)
        generation = self._leader.generation(r.options)
        group = group_of(generation, r.options.group_id)
        if SPECS[kind].root_role:
            check_root(
                SPECS[kind], root, generation.world_size, group.ranks if group.group_id else None
            )
        args = worker_pb2.CoalescedArgs(names=names, outs=outs, op=op, root=root)
        desc = worker_pb2.OpDescriptor(
            kind=kind, group_id=group.group_id, timeout_s=r.options.timeout_s, coalesced=args
        )
        result = self._leader.run(context, generation, desc, r.options)
        return worker_pb2.CollectiveResponse(
            op_id=result.op_id,
            generation=result.generation,
            result_name=result.result_name,
            result_ranks=result.result_ranks,
            latency_s=result.latency_s,
            result_names=result.result_names,
        )

    @_guard
    def Broadcast(self, r, context):
        if r.names:
            return self._coalesced(context, OpKind.BROADCAST_COALESCED, r, root=r.src)
        args = worker_pb2.TensorOpArgs(name=r.name, root=r.src)
        return self._collective(context, OpKind.BROADCAST, r.options, args)

    @_guard
    def AllReduce(self, r, context):
        if r.names:
            return self._coalesced(context, OpKind.ALL_REDUCE_COALESCED, r, list(r.outs), op=r.op)
        args = worker_pb2.TensorOpArgs(name=r.name, out=r.out, op=r.op)
        return self._collective(context, OpKind.ALL_REDUCE, r.options, args)

    @_guard
    def Reduce(self, r, context):
        args = worker_pb2.TensorOpArgs(name=r.name, out=r.out, op=r.op, root=r.dst)
        return self._collective(context, OpKind.REDUCE, r.options, args)

    @_guard
    def AllGather(self, r, context):
        if r.names:
            return self._coalesced(context, OpKind.ALL_GATHER_COALESCED, r, list(r.outs))
        args = worker_pb2.TensorOpArgs(name=r.name, out=r.out)
        return self._collective(context, OpKind.ALL_GATHER, r.options, args)

    @_guard
    def Gather(self, r, context):
        args = worker_pb2.TensorOpArgs(name=r.name, out=r.out, root=r.dst)
        return self._collective(context, OpKind.GATHER, r.options, args)

    @_guard
    def ReduceScatter(self, r, context):
        args = worker_pb2.TensorOpArgs(name=r.name, out=r.out, op=r.op)
        return self._collective(context, OpKind.REDUCE_SCATTER, r.options, args)

    @_guard
    def AllToAll(self, r, context):
        if r.split_sizes:
            return self._uneven_all_to_all(context, r)
        args = worker_pb2.TensorOpArgs(name=r.name, out=r.out)
        return self._collective(context, OpKind.ALL_TO_ALL, r.options, args)

    def _uneven_all_to_all(
        self, context, r: worker_pb2.AllToAllRequest
    ) -> worker_pb2.CollectiveResponse:
        """all_to_all with ``split_sizes`` (``handlers/uneven_ops``). Every member stores a
        result of its own dim 0 (its column's sum); the reply's shape is the first
        member's (the leader's, whenever the leader is a member)."""
        validate_name(r.name)
        if r.out:
            validate_name(r.out, "out name")
        generation = self._leader.generation(r.options)
        group = group_of(generation, r.options.group_id)
        size = len(group.ranks)
        op_args.check_split_matrix(op_args.split_rows(list(r.split_sizes), size), size)
        desc = worker_pb2.OpDescriptor(
            kind=OpKind.ALL_TO_ALL_UNEVEN,
            group_id=group.group_id,
            timeout_s=r.options.timeout_s,
            uneven=worker_pb2.UnevenAllToAllArgs(name=r.name, out=r.out, split_sizes=r.split_sizes),
        )
        result = self._leader.run(context, generation, desc, r.options)
        return collective_response(result)

    @_guard
    def Barrier(self, r, context):
        return self._collective(context, OpKind.BARRIER, r.options, worker_pb2.TensorOpArgs())

    @_guard
    def NewGroup(self, r, context):
        generation = self._leader.generation(r.options)
        ranks = check_group_ranks(list(r.ranks), generation.world_size)
        check_group_cap(
            subgroup_count(generation.groups), generation.max_groups, generation.generation
        )
        desc = worker_pb2.OpDescriptor(
            kind=OpKind.NEW_GROUP,
            group_id=generation.allocate_group_id(),
            timeout_s=r.options.timeout_s,
            new_group=worker_pb2.NewGroupArgs(ranks=ranks),
        )
        result = self._leader.run(context, generation, desc, r.options)
        return worker_pb2.NewGroupResponse(
            group_id=desc.group_id, generation=result.generation, ranks=result.result_ranks
        )


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
    handlers = worker_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def worker_handlers(servicer: WorkerService) -> dict[str, grpc.RpcMethodHandler]:
    """The handler of every Worker method ``servicer`` implements, by method name."""
    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        deserializer = None if method.name in _RAW_REQUEST else request_cls.FromString
        serializer = None if method.name in _RAW_RESPONSE else response_cls.SerializeToString
        behaviour = servicer.rpc(method.name)
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
    return handlers
