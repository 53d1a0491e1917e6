"""The flight record as Chrome Trace Event JSON (``collectives trace``).

Perfetto (ui.perfetto.dev) and chrome://tracing open it. Layout: a process per
rank (``pid`` = the rank), a track per phase (``tid``: 1 queued on the
leader, 2 announced until its handler started, 3 the handler: operand
agreement, the data collective and the commit), each phase a complete event
(``ph`` "X") named after the op, and one flow per op (``ph`` "s" on the first
rank, "t" on the ranks between, "f" on the last) linking the op across ranks.
Times are microseconds since the earliest stamp in the record; ``otherData``
holds that origin as Unix seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from collectives.observe.flight_record import OpRecord, RankPhases
from collectives.wire.op_phases import SPANS

__all__ = ["TRACKS", "trace_events"]

# track id -> (its name, the phase it starts at, the phase it ends at)
TRACKS = dict(enumerate(SPANS, start=1))


def _label(op: OpRecord) -> str:
    names = ", ".join(repr(n) for n in op.names)
    which = op.call_id[:12] if op.call_id else op.op_id
    return f"{which} {op.kind} {names}".rstrip()


def trace_events(ops: Iterable[OpRecord], now_s: float | None = None) -> dict[str, Any]:
    """The Chrome trace of ``ops``; an op still in flight on a rank ends its open phase
    at ``now_s`` (Unix seconds; default: its last stamp)."""
    ops = list(ops)
    stamps = [s for op in ops for r in op.per_rank.values() for s in r.phases.values()]
    origin = min(stamps, default=0.0)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    ranks = sorted({r for op in ops for r in op.per_rank})
    for rank in ranks:
        events.append(_meta("process_name", rank, 0, f"rank {rank}"))
        events.append(_meta("process_sort_index", rank, 0, rank, key="sort_index"))
        for tid, (name, _, _) in TRACKS.items():
            events.append(_meta("thread_name", rank, tid, name))
    for flow_id, op in enumerate(ops, start=1):
        label = _label(op)
        args = {
            "op_id": op.op_id,
            "call_id": op.call_id,
            "generation": op.generation,
            "kind": op.kind,
            "names": list(op.names),
            "nbytes": op.nbytes,
            "ranks": list(op.ranks),
            "client": op.client,
            "outcome": op.outcome,
        }
        anchors: list[tuple[int, float]] = []  # (rank, ts) of each rank's first event
        for rank, phases in op.per_rank.items():
            first = None
            for tid, (_, begin, end) in TRACKS.items():
                span = _span(phases, begin, end, now_s)
                if span is None:
                    continue
                start, stop = span
                if first is None:
                    first = (tid, us(start))
                events.append(
                    {
                        "name": label,
                        "cat": op.kind,
                        "ph": "X",
                        "ts": us(start),
                        "dur": max(0.0, round((stop - start) * 1e6, 3)),
                        "pid": rank,
                        "tid": tid,
                        "args": {**args, "rank_outcome": phases.outcome},
                    }
                )
            if first is not None:
                anchors.append((rank, *first))  # type: ignore[arg-type]
        events.extend(_flow(flow_id, label, op.kind, anchors))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_s": origin}}


def _span(
    phases: RankPhases, begin: str, end: str, now_s: float | None
) -> tuple[float, float] | None:
    start = phases.phases.get(begin)
    if start is None:
        return None
    stop = phases.phases.get(end)
    if stop is None:
        if phases.outcome != "in flight":
            return None  # it ended without reaching this phase's end (failed earlier)
        stop = now_s if now_s is not None else max(phases.phases.values())
    return start, max(start, stop)


def _flow(flow_id: int, label: str, kind: str, anchors: list[Any]) -> list[dict[str, Any]]:
    """One flow through every rank's first event of the op (none for a single rank)."""
    if len(anchors) < 2:
        return []
    anchors = sorted(anchors, key=lambda a: (a[2], a[0]))
    steps = ["s"] + ["t"] * (len(anchors) - 2) + ["f"]
    return [
        {
            "name": label,
            "cat": f"op.{kind}",
            "ph": ph,
            "id": flow_id,
            "ts": ts,
            "pid": rank,
            "tid": tid,
            **({"bp": "e"} if ph != "s" else {}),
        }
        for ph, (rank, tid, ts) in zip(steps, anchors, strict=True)
    ]


def _meta(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {key: value}}
