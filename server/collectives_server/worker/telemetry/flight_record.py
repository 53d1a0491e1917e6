"""A worker's flight record as GetFlightRecord answers it, as its status summarises it
(its last ops and its own stuck verdict), and its phase histograms.

The ring itself is the engine's (``engine/flight_recorder.py``); this module
reads it and says where this worker stands: its rank and generation, its
clock (so a reader can tell how long an op has been in flight), the ring's
capacity and the op timeout a diagnosis measures against.

:class:`PhaseHistograms` folds every finished op of the ring into the
``collectives_op_phase_seconds{kind,phase}`` histogram when the metrics are
scraped, so the op's own thread records nothing more than its stamps. Its
phases are the spans of :mod:`collectives.wire.op_phases` (the trace's tracks).
"""

from __future__ import annotations

import bisect
import threading
import time

from collectives.v1 import flight_record_pb2, status_pb2
from collectives.wire.op_phases import DOING, PHASES, SPANS, stamp_fields
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.engine.flight_recorder import FlightRecorder, RecordedOp

__all__ = [
    "PHASE_BUCKETS_S", "RESPONSE_BYTES", "STATUS_OPS", "PhaseHistograms", "add_flight_summary",
    "flight_record_response", "stuck_here",
]  # fmt: skip

# The ops of the flight recorder every heartbeat's status carries.
STATUS_OPS = 24
# A GetFlightRecord answer's ops stay under this many bytes (well under the gRPC
# message bound); a reader pages for older ones (FlightRecordRequest.before_seq).
RESPONSE_BYTES = 2 * 1024 * 1024
# A repeated message field's tag and length prefix, at most.
_FIELD_OVERHEAD = 6

# Upper bounds of the phase histogram (seconds); +Inf is implied.
PHASE_BUCKETS_S = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)  # fmt: skip

# histogram phase -> (the stamp it starts at, the stamp it ends at)
_SPANS = {name: (begin, end) for name, begin, end in SPANS}


class PhaseHistograms:
    """Cumulative phase durations by (kind, phase), folded from a flight recorder."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0  # the recorder's sequence number folded up to
        # (kind, phase) -> (bucket counts, the last one +Inf; the sum of seconds)
        self._histograms: dict[tuple[str, str], tuple[list[int], list[float]]] = {}

    def fold(self, recorder: FlightRecorder) -> dict[tuple[str, str], tuple[list[int], float]]:
        """Folds the ops that finished since the last call; returns every histogram."""
        with self._lock:
            ops, self._seq = recorder.finished_since(self._seq)
            for op in ops:
                phases = op.phases
                for phase, (begin, end) in _SPANS.items():
                    if begin in phases and end in phases:
                        seconds = max(0.0, phases[end] - phases[begin])
                        counts, total = self._histograms.setdefault(
                            (op.kind, phase), ([0] * (len(PHASE_BUCKETS_S) + 1), [0.0])
                        )
                        counts[bisect.bisect_left(PHASE_BUCKETS_S, seconds)] += 1
                        total[0] += seconds
            return {k: (list(c), t[0]) for k, (c, t) in self._histograms.items()}


def flight_record_response(
    ctx: WorkerContext, last: int = 0, before_seq: int = 0
) -> flight_record_pb2.FlightRecordResponse:
    """The last ``last`` ops of ``ctx``'s flight recorder (0: all it holds) recorded
    before sequence number ``before_seq`` (0: up to the newest), oldest first: the
    newest of them that fit in :data:`RESPONSE_BYTES`, and in ``older`` how many
    more the ring holds before them (the reader's next page)."""
    runtime = ctx.runtime
    reply = flight_record_pb2.FlightRecordResponse(
        rank=runtime.rank if runtime is not None else -1,
        generation=runtime.generation if runtime is not None else 0,
        worker_id=ctx.worker_id,
        address=ctx.address,
        capacity=ctx.recorder.capacity,
        op_timeout_s=ctx.op_timeout_s,
    )
    ops = ctx.recorder.snapshot(last, before_seq)
    kept: list[flight_record_pb2.FlightRecordOp] = []
    budget = RESPONSE_BYTES
    for op in reversed(ops):
        proto = _op_proto(op)
        budget -= proto.ByteSize() + _FIELD_OVERHEAD
        if budget < 0:
            break
        kept.append(proto)
    kept.reverse()
    reply.ops.extend(kept)
    if kept:
        reply.first_seq = ops[len(ops) - len(kept)].seq
        reply.older = ctx.recorder.held_before(reply.first_seq)
    reply.now_s = time.time()
    return reply


def add_flight_summary(msg: status_pb2.WorkerStatus, ctx: WorkerContext) -> None:
    """Puts the last :data:`STATUS_OPS` ops (without their messages) and this worker's
    own stuck verdict into its status: the dashboard's timeline and warning."""
    ops = ctx.recorder.snapshot(STATUS_OPS)
    msg.recent_ops.extend(_op_proto(op, message=False) for op in ops)
    msg.stuck = stuck_here(ops, ctx.op_timeout_s / 4)


def stuck_here(ops: list[RecordedOp], threshold_s: float, now_s: float | None = None) -> str:
    """This worker's oldest op in flight longer than ``threshold_s`` in words, or ""."""
    now_s = time.time() if now_s is None else now_s
    for op in ops:
        reached = [p for p in PHASES[1:-1] if p in op.phases]  # announced, then started
        if not op.in_flight or not reached:
            continue
        phase = reached[-1]
        seconds = now_s - op.phases[phase]
        if seconds >= threshold_s:
            names = " ".join(repr(n) for n in op.names)
            return (
                f"op {op.op_id} {op.kind}{' ' + names if names else ''} "
                f"(generation {op.generation}): {DOING[phase]} for {seconds:.1f} s "
                f"on rank {op.rank}"
            )
    return ""


def _op_proto(op: RecordedOp, message: bool = True) -> flight_record_pb2.FlightRecordOp:
    phases = op.phases
    return flight_record_pb2.FlightRecordOp(
        op_id=op.op_id,
        generation=op.generation,
        rank=op.rank,
        kind=op.kind,
        names=op.names,
        ranks=op.ranks,
        client=op.client if message else "",
        **stamp_fields(phases),
        code=op.code,
        message=op.message if message else "",
        nbytes=op.nbytes,
        dtype=op.dtype,
        call_id=op.call_id,
        names_omitted=op.names_omitted,
        message_chars_omitted=op.message_omitted if message else 0,
    )
