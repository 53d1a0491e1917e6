"""The reply the leader sends for a collective that committed, built once for every
collective RPC (tensor ops, uneven all_to_all, exchange)."""

from __future__ import annotations

from collectives.v1 import worker_pb2
from collectives.wire.dtypes import to_wire
from collectives_server.worker.engine.op_context import OpResult

__all__ = ["collective_response"]


def collective_response(result: OpResult) -> worker_pb2.CollectiveResponse:
    """The ``CollectiveResponse`` of a committed op."""
    return worker_pb2.CollectiveResponse(
        op_id=result.op_id,
        generation=result.generation,
        result_name=result.result_name,
        result_ranks=result.result_ranks,
        dtype=to_wire(result.dtype) if result.dtype is not None else 0,
        shape=list(result.shape),
        latency_s=result.latency_s,
    )
