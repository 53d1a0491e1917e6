"""The cluster's flight record: every rank's recent ops, merged by op.

Every worker keeps a bounded ring of the ops it ran, each with the time it
reached each phase (``--flight-recorder-ops``; the worker's
``engine/flight_recorder.py``). The leader sequences every op, so an op has
one identity on every rank: (generation, op id). :func:`read_flight_record`
asks every rank for its ring (``GetFlightRecord``, in parallel, each within a
deadline) and :func:`merge` joins the answers into one :class:`OpRecord` per
op, with each rank's phase times. ``cluster.flight_record()``, ``collectives
trace`` (``collectives.observe.trace_events``) and ``collectives diagnose``
(``stuck_ops``) read it. A tool in another language reads the same fields
(``protos/collectives/v1/flight_record.proto``) and phases. Nothing here needs torch.

The phases and their order: :mod:`collectives.wire.op_phases` (Unix seconds
here; a phase not reached is absent).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import grpc

from collectives.errors import status_code
from collectives.v1 import flight_record_pb2, worker_pb2_grpc
from collectives.wire.cluster_state import ClusterSnapshot
from collectives.wire.op_phases import PHASES, phases_of

__all__ = [
    "PHASES",
    "FlightRecord",
    "OpRecord",
    "RankPhases",
    "RankReply",
    "merge",
    "read_flight_record",
    "read_paged",
]


def _outcome(code: int) -> str:
    if code < 0:
        return "in flight"
    if code == 0:
        return "ok"
    status = status_code(code)
    return status.name if status is not grpc.StatusCode.UNKNOWN or code == 2 else f"code {code}"


@dataclass(frozen=True)
class RankPhases:
    """One op on one rank: when it reached each phase, and how it ended there."""

    rank: int
    # phase name (see PHASES) -> Unix seconds; phases not reached are absent.
    phases: Mapping[str, float]
    # "ok", "in flight", or the gRPC status code's name ("FAILED_PRECONDITION", ...).
    outcome: str
    message: str = ""
    # This rank's result: its bytes and dtype (0 and "": none, or not known).
    nbytes: int = 0
    dtype: str = ""

    @property
    def phase(self) -> str:
        """The last phase this rank reached."""
        reached = [p for p in PHASES if p in self.phases]
        return reached[-1] if reached else ""


@dataclass(frozen=True)
class OpRecord:
    """One op as every rank that answered recorded it (``cluster.flight_record()``)."""

    op_id: int
    generation: int
    kind: str  # "all_reduce", "broadcast", "publish_model", "forward", ...
    names: tuple[str, ...]  # the tensors (or model) it named
    nbytes: int  # the largest result any rank reported (0: none, or not known)
    ranks: tuple[int, ...]  # the global ranks of its group
    client: str  # the peer that issued it, as the leader saw it ("" if not known)
    # "ok" when every rank that answered committed it, "in flight" while any rank
    # runs it, else the first failure's status code name.
    outcome: str
    # rank -> that rank's phase times, for the ranks that answered and still hold it.
    per_rank: Mapping[int, RankPhases] = field(default_factory=dict)
    # A forward (run by each worker on its own, op_id 0): its call id, shared by the
    # ranks that ran a share of one data-parallel call.
    call_id: str = ""
    # Names the workers' records left out (they keep an op's first 16; ``names``
    # holds those).
    names_omitted: int = 0

    @property
    def label(self) -> str:
        """How the CLI and the trace name it: ``op 812``, or ``call 3f9a…`` for a forward."""
        return f"op {self.op_id}" if not self.call_id else f"call {self.call_id[:12]}"

    @property
    def slowest_rank(self) -> int | None:
        """The straggler: the rank the others waited for, the last to reach the op's data
        phase (``started``), ties going to the last to finish; None until two ranks
        started it."""
        arrived = [
            (r.phases["started"], r.phases.get("finished", 0.0), r.rank)
            for r in self.per_rank.values()
            if "started" in r.phases
        ]
        return max(arrived)[2] if len(arrived) > 1 else None


@dataclass(frozen=True)
class RankReply:
    """One worker's answer to GetFlightRecord, or why it gave none."""

    rank: int  # the worker's rank now (-1: not a member of the current generation)
    address: str
    reply: flight_record_pb2.FlightRecordResponse | None
    error: str = ""


@dataclass(frozen=True)
class FlightRecord:
    """What every rank answered, and the ops merged from it."""

    snapshot: ClusterSnapshot
    replies: tuple[RankReply, ...]
    ops: tuple[OpRecord, ...]


def merge(replies: Iterable[RankReply], last: int = 0) -> list[OpRecord]:
    """One :class:`OpRecord` per (generation, op id) any rank recorded, and one per
    forward call, in the order they began (sequenced ops: op order); ``last`` > 0
    keeps the last ``last`` of them."""
    by_op: dict[tuple[int, int, str], list[tuple[int, flight_record_pb2.FlightRecordOp]]] = {}
    for answer in replies:
        if answer.reply is None:
            continue
        for op in answer.reply.ops:
            by_op.setdefault((op.generation, op.op_id, op.call_id), []).append((op.rank, op))
    records = sorted(
        (_record(key, seen) for key, seen in by_op.items()),
        key=lambda r: (r.generation, _began(r), r.op_id, r.call_id),
    )
    return records[-last:] if last > 0 else records


def _began(record: OpRecord) -> float:
    """When the op or call began: its earliest phase on any rank."""
    return min((s for r in record.per_rank.values() for s in r.phases.values()), default=0.0)


def _record(
    key: tuple[int, int, str], seen: list[tuple[int, flight_record_pb2.FlightRecordOp]]
) -> OpRecord:
    generation, op_id, call_id = key
    per_rank: dict[int, RankPhases] = {}
    for rank, op in seen:
        per_rank[rank] = RankPhases(
            rank=rank,
            phases=phases_of(op),
            outcome=_outcome(op.code),
            message=op.message,
            nbytes=op.nbytes,
            dtype=op.dtype,
        )
    first = seen[0][1]
    outcomes = [per_rank[r].outcome for r in sorted(per_rank)]
    failed = [o for o in outcomes if o not in ("ok", "in flight")]
    outcome = "in flight" if "in flight" in outcomes else failed[0] if failed else "ok"
    return OpRecord(
        op_id=op_id,
        generation=generation,
        kind=first.kind,
        names=tuple(first.names),
        nbytes=max(op.nbytes for _, op in seen),
        ranks=tuple(first.ranks) or tuple(sorted(per_rank)),
        client=next((op.client for _, op in seen if op.client), ""),
        outcome=outcome,
        per_rank=dict(sorted(per_rank.items())),
        call_id=call_id,
        names_omitted=max(op.names_omitted for _, op in seen),
    )


# A worker answers at most a few MiB of ops at a time (older ones on the next page);
# a ring of the largest records takes a few pages, never more than this.
_MAX_PAGES = 64


def read_paged(
    stub: worker_pb2_grpc.WorkerStub, last: int, timeout: float
) -> flight_record_pb2.FlightRecordResponse:
    """A worker's last ``last`` ops (0: all it holds), asked page by page, newest
    first, within ``timeout`` in all; one answer, oldest first."""
    deadline = time.monotonic() + timeout
    pages: list[flight_record_pb2.FlightRecordResponse] = []
    before, got = 0, 0
    while len(pages) < _MAX_PAGES:
        wanted = last - got if last else 0
        request = flight_record_pb2.FlightRecordRequest(last=wanted, before_seq=before)
        page = stub.GetFlightRecord(request, timeout=max(deadline - time.monotonic(), 0.001))
        pages.append(page)
        got += len(page.ops)
        if not page.ops or not page.older or (last and got >= last):
            break
        before = page.first_seq
    answer = flight_record_pb2.FlightRecordResponse()
    answer.CopyFrom(pages[0])
    del answer.ops[:]
    for page in reversed(pages):
        answer.ops.extend(page.ops)
    answer.first_seq = pages[-1].first_seq
    answer.older = pages[-1].older
    return answer


def read_flight_record(
    snapshot: ClusterSnapshot,
    channel_for: Callable[[str], grpc.Channel],
    last: int = 0,
    ranks: Iterable[int] | None = None,
    timeout: float = 5.0,
) -> FlightRecord:
    """Asks every member of ``snapshot`` (or ``ranks`` of them) for its last ``last``
    ops, in parallel, each within ``timeout`` seconds; a rank that does not answer
    is in ``replies`` with its error. ``channel_for(address)``: a channel to a worker."""
    wanted = set(ranks) if ranks is not None else None
    # Every worker by default, members or not: one that left the generation still
    # holds the ops it ran in it (each op names the rank it ran as).
    if wanted is None:
        members = [w for w in snapshot.workers if w.address]
    else:
        members = [w for w in snapshot.workers if w.rank >= 0 and w.rank in wanted]

    def ask(rank: int, address: str) -> RankReply:
        try:
            stub = worker_pb2_grpc.WorkerStub(channel_for(address))
            return RankReply(rank, address, read_paged(stub, max(0, last), timeout))
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            detail = err.details() if hasattr(err, "details") else str(err)
            name = code.name if code is not None else "error"
            return RankReply(rank, address, None, f"{name}: {detail}")

    replies: list[RankReply] = []
    if members:
        with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
            futures = [pool.submit(ask, w.rank, w.address) for w in members]
            replies = [f.result() for f in futures]
    ops = merge(replies, last)
    return FlightRecord(snapshot, tuple(sorted(replies, key=lambda r: r.rank)), tuple(ops))
