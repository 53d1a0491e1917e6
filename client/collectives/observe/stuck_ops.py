"""What is stuck: the ranks' flight records compared, live (``collectives diagnose``).

Like torch's flight-recorder analyzer, but on the running cluster: an op in
flight on some rank for longer than a threshold (default: a quarter of the op
timeout) is stuck. Its phase is the furthest any rank reached; the ranks of
its group that have not reached that phase, or did not answer, are the ones
it waits on; each is named with its last heartbeat (the coordinator's view)
and its own current op. When every rank is in the same phase, none is
missing: the op itself is slow (a large transfer, a slow device) or the
ranks deadlocked inside it, and the verdict says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from collectives.observe.flight_record import FlightRecord, OpRecord, RankReply
from collectives.wire.op_phases import DOING, PHASES, phases_of

__all__ = ["Stuck", "diagnose"]


@dataclass(frozen=True)
class Stuck:
    """One op in flight longer than the threshold, and the ranks it waits on."""

    op: OpRecord
    phase: str  # the furthest phase a rank reached (announced or started)
    for_s: float  # how long the op has been in that phase on the rank that reached it first
    waiting_on: tuple[int, ...]  # ranks behind that phase, or not answering
    line: str  # the verdict in words


def _now(reply: RankReply) -> float:
    return reply.reply.now_s if reply.reply is not None else 0.0


def _current_op(reply: RankReply | None) -> str:
    """A rank's own current op in words (its latest op still in flight, else its last)."""
    if reply is None or reply.reply is None:
        return "unknown (it did not answer)"
    ops = list(reply.reply.ops)
    if not ops:
        return "none recorded"
    busy = [o for o in ops if o.code < 0 and o.announced_s]
    op = busy[-1] if busy else ops[-1]
    reached = list(phases_of(op))
    phase = reached[-1] if reached else ""
    state = f"still in its {DOING.get(phase, phase)}" if op.code < 0 else "finished"
    return f"{op.op_id} {op.kind}, {state}"


def diagnose(record: FlightRecord, threshold_s: float) -> list[Stuck]:
    """Every op in flight on some rank for longer than ``threshold_s``, oldest first."""
    replies = {r.rank: r for r in record.replies}
    clock = max((_now(r) for r in record.replies), default=0.0)
    heartbeat = {w.rank: w.last_heartbeat_age_s for w in record.snapshot.workers if w.rank >= 0}
    found: list[Stuck] = []
    for op in record.ops:
        if op.outcome != "in flight":
            continue
        in_flight = [p for p in op.per_rank.values() if p.outcome == "in flight" and p.phase]
        in_flight = [p for p in in_flight if p.phase != "admitted"]
        if not in_flight:
            continue
        furthest = max(PHASES.index(p.phase) for p in in_flight)
        phase = PHASES[furthest]
        since = min(p.phases[phase] for p in in_flight if p.phase == phase)
        for_s = clock - since
        if for_s < threshold_s:
            continue
        waiting: list[int] = []
        for rank in op.ranks:
            reply = replies.get(rank)
            mine = op.per_rank.get(rank)
            if (
                reply is None
                or reply.reply is None
                or mine is None
                or (
                    mine.outcome == "in flight"
                    and PHASES.index(mine.phase or "admitted") < furthest
                )
            ):
                waiting.append(rank)
        found.append(
            Stuck(
                op,
                phase,
                for_s,
                tuple(waiting),
                _line(op, phase, for_s, waiting, replies, heartbeat),
            )
        )
    return found


def _line(
    op: OpRecord,
    phase: str,
    for_s: float,
    waiting: list[int],
    replies: dict[int, RankReply],
    heartbeat: dict[int, float],
) -> str:
    names = " ".join(repr(n) for n in op.names)
    head = f"{op.label} {op.kind}{' ' + names if names else ''} (generation {op.generation})"
    head += f": {DOING.get(phase, phase)} for {for_s:.1f} s"
    if not waiting:
        ranks = ", ".join(str(r) for r in sorted(op.per_rank))
        return f"{head}; no rank is missing: every rank of its group ({ranks}) is in it"
    parts = []
    for rank in waiting:
        reply = replies.get(rank)
        answered = reply is not None and reply.reply is not None
        age = heartbeat.get(rank)
        beat = f"heartbeat {age:.1f} s ago" if age is not None else "no heartbeat known"
        alive = "alive" if answered else "not answering"
        parts.append(f"rank {rank} — {alive} ({beat}), its current op: {_current_op(reply)}")
    return f"{head}; waiting on " + "; ".join(parts)
