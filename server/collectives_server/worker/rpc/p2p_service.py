"""The point-to-point, replication and group-teardown RPCs of the Worker service.

A part of :class:`~collectives_server.worker.rpc.service.WorkerService`: ``Exchange``
(``send`` and ``batch_isend_irecv``) and ``DestroyGroup`` are checked here with
the rules the SDK applies (``op_args.check_pairs``), then sequenced by the
leader like any op and run by ``handlers.exchange_ops`` / ``handlers.group_ops``.
``ReplicateTensor`` (``put`` on every rank with each byte sent once) checks its
names and that the upload is here, then runs ``handlers.replicate_ops``.
"""

from __future__ import annotations

from collectives.errors import InvalidArgument, NotFound
from collectives.v1 import worker_pb2
from collectives.wire.names import UPLOAD_PREFIX, validate_name
from collectives.wire.op_args import check_pairs
from collectives.wire.op_specs import OpKind
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.data.store import upload_prefix
from collectives_server.worker.engine.handlers.group_ops import group_not_found
from collectives_server.worker.rpc.guards import guard as _guard
from collectives_server.worker.rpc.leader import Leader, collective_response

__all__ = ["PeerRpcs"]


class PeerRpcs:
    """Exchange, ReplicateTensor and DestroyGroup, over the worker's context; ops run
    through ``leader``."""

    def __init__(self, ctx: WorkerContext, leader: Leader) -> None:
        self._ctx = ctx
        self._leader = leader

    @_guard
    def Exchange(self, r: worker_pb2.ExchangeRequest, context) -> worker_pb2.CollectiveResponse:
        validate_name(r.name)
        if r.out:
            validate_name(r.out, "out name")
        generation = self._leader.generation(r.options)
        group = generation.groups.get(r.options.group_id)
        if group is None:
            raise group_not_found(r.options.group_id, generation.generation)
        pairs = check_pairs([(p.src, p.dst) for p in r.pairs], generation.world_size, group.ranks)
        args = worker_pb2.ExchangeArgs(
            name=r.name, out=r.out, srcs=[s for s, _ in pairs], dsts=[d for _, d in pairs]
        )
        desc = worker_pb2.OpDescriptor(
            kind=OpKind.EXCHANGE,
            group_id=group.group_id,
            timeout_s=r.options.timeout_s,
            exchange=args,
        )
        result = self._leader.run(context, generation, desc, r.options)
        return collective_response(result)

    @_guard
    def DestroyGroup(
        self, r: worker_pb2.DestroyGroupRequest, context
    ) -> worker_pb2.DestroyGroupResponse:
        group_id = r.options.group_id
        if group_id == 0:
            raise InvalidArgument("group 0 is every rank of the generation; it cannot be destroyed")
        generation = self._leader.generation(r.options)
        if group_id not in generation.groups:
            raise group_not_found(group_id, generation.generation)
        desc = worker_pb2.OpDescriptor(
            kind=OpKind.DESTROY_GROUP,
            timeout_s=r.options.timeout_s,
            destroy_group=worker_pb2.DestroyGroupArgs(group_id=group_id),
        )
        result = self._leader.run(context, generation, desc, r.options)
        return worker_pb2.DestroyGroupResponse(generation=result.generation)

    @_guard
    def ReplicateTensor(
        self, r: worker_pb2.ReplicateTensorRequest, context
    ) -> worker_pb2.CollectiveResponse:
        validate_name(r.name)
        if r.name.startswith(UPLOAD_PREFIX):
            raise InvalidArgument(
                f"tensor names under {UPLOAD_PREFIX!r} are reserved for uploads; "
                f"{r.name[:64]!r} cannot be a put's target"
            )
        validate_name(r.upload, "upload name")
        if not r.upload.startswith(UPLOAD_PREFIX) or upload_prefix(r.upload) == r.upload:
            raise InvalidArgument(
                f"upload name {r.upload[:64]!r} must look like '{UPLOAD_PREFIX}<id>/<key>'"
            )
        if r.options.group_id:
            raise InvalidArgument("a replicated put stores on every rank: group_id must be 0")
        generation = self._leader.generation(r.options)
        if self._ctx.store.peek(r.upload) is None:
            raise NotFound(f"nothing was uploaded under {r.upload!r} on this worker; put first")
        desc = worker_pb2.OpDescriptor(
            kind=OpKind.REPLICATE,
            timeout_s=r.options.timeout_s,
            replicate=worker_pb2.TensorOpArgs(name=r.upload, out=r.name, root=generation.rank),
        )
        result = self._leader.run(context, generation, desc, r.options)
        return collective_response(result)
