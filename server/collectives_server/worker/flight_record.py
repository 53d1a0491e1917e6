"""A worker's flight record as GetFlightRecord answers it.

The ring itself is the engine's (``engine/flight_recorder.py``); this module
reads it and says where this worker stands: its rank and generation, its
clock (so a reader can tell how long an op has been in flight), the ring's
capacity and the op timeout a diagnosis measures against.
"""

from __future__ import annotations

import time

from collectives.v1 import flight_record_pb2
from collectives_server.worker.context import WorkerContext

__all__ = ["flight_record_response"]


def flight_record_response(
    ctx: WorkerContext, last: int = 0
) -> flight_record_pb2.FlightRecordResponse:
    """The last ``last`` ops of ``ctx``'s flight recorder (0: all it holds), oldest first."""
    runtime = ctx.runtime
    reply = flight_record_pb2.FlightRecordResponse(
        rank=runtime.rank if runtime is not None else -1,
        generation=runtime.generation if runtime is not None else 0,
        worker_id=ctx.worker_id,
        address=ctx.address,
        capacity=ctx.recorder.capacity,
        op_timeout_s=ctx.op_timeout_s,
    )
    for op in ctx.recorder.snapshot(last):
        phases = op.phases
        reply.ops.add(
            op_id=op.op_id,
            generation=op.generation,
            rank=op.rank,
            kind=op.kind,
            names=op.names,
            ranks=op.ranks,
            client=op.client,
            admitted_s=phases.get("admitted", 0.0),
            announced_s=phases.get("announced", 0.0),
            started_s=phases.get("started", 0.0),
            finished_s=phases.get("finished", 0.0),
            code=op.code,
            message=op.message,
            nbytes=op.nbytes,
            dtype=op.dtype,
        )
    reply.now_s = time.time()
    return reply
