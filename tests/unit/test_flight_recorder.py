"""The flight recorder's ring, the merge by op, the Chrome trace and the diagnosis:
pure logic over hand-made records (the live cluster checks are in
tests/integration/test_flight_record.py)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
import torch

from collectives.observe.flight_record import FlightRecord, RankReply, merge
from collectives.observe.status_tables import format_table
from collectives.observe.stuck_ops import diagnose
from collectives.observe.trace_events import trace_events
from collectives.v1 import flight_record_pb2, worker_pb2
from collectives.wire.cluster_state import ClusterSnapshot, WorkerInfo, WorkerState
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine.flight_recorder import FlightRecorder, op_names
from collectives_server.worker.engine.op_context import OpResult


def _desc(op_id: int, name: str = "x", kind: OpKind = OpKind.ALL_REDUCE) -> worker_pb2.OpDescriptor:
    desc = worker_pb2.OpDescriptor(op_id=op_id, generation=3, kind=kind)
    desc.tensor.name = name
    return desc


def test_the_ring_keeps_the_last_ops_with_their_phases() -> None:
    recorder = FlightRecorder(4)
    for op_id in range(1, 7):
        now = time.monotonic()
        slot = recorder.open(_desc(op_id), 0, [0, 1], now, admitted=now - 0.01, client="peer")
        assert slot is not None
        slot.started = now + 0.001
        result = OpResult(op_id, 3, "x", [0, 1], torch.float32, (2, 3), 0.0)
        slot.finish(now + 0.002, 0, "", result)
    ops = recorder.snapshot()
    assert [op.op_id for op in ops] == [3, 4, 5, 6]
    assert [op.op_id for op in recorder.snapshot(2)] == [5, 6]
    op = ops[-1]
    assert (op.kind, op.names, op.ranks, op.client, op.code) == (
        "all_reduce",
        ("x",),
        (0, 1),
        "peer",
        0,
    )
    assert (op.nbytes, op.dtype) == (24, "float32")
    stamps = [op.phases[p] for p in ("admitted", "announced", "started", "finished")]
    assert stamps == sorted(stamps)
    assert abs(op.phases["announced"] - time.time()) < 5  # wall clock at read


def test_an_op_in_flight_has_no_outcome_yet() -> None:
    recorder = FlightRecorder(2)
    recorder.open(_desc(1), 0, None, time.monotonic())
    (op,) = recorder.snapshot()
    assert op.in_flight and "finished" not in op.phases and "admitted" not in op.phases


def test_zero_turns_recording_off() -> None:
    recorder = FlightRecorder(0)
    assert not recorder.enabled
    assert recorder.open(_desc(1), 0, None, time.monotonic()) is None
    assert recorder.snapshot() == []
    with pytest.raises(ValueError):
        FlightRecorder(-1)


def test_op_names_reads_the_names_of_any_args() -> None:
    desc = worker_pb2.OpDescriptor(kind=OpKind.ALL_REDUCE_COALESCED)
    desc.coalesced.names.extend(["a", "b"])
    assert op_names(desc) == ("a", "b")
    desc = worker_pb2.OpDescriptor(kind=OpKind.TRAIN_STEP)
    desc.train_step.model = "mlp"
    assert op_names(desc) == ("mlp",)
    assert op_names(worker_pb2.OpDescriptor(kind=OpKind.BARRIER)) == ()


# ------------------------------------------------------------- merge, trace, diagnose
T0 = 1_700_000_000.0


def _op(
    op_id: int, *stamps: float, code: int = 0, ranks=(0, 1, 2)
) -> flight_record_pb2.FlightRecordOp:
    names = ("admitted_s", "announced_s", "started_s", "finished_s")
    op = flight_record_pb2.FlightRecordOp(
        op_id=op_id, generation=3, kind="all_reduce", names=["grads"], ranks=list(ranks), code=code
    )  # fmt: skip
    for name, stamp in zip(names, stamps, strict=False):
        setattr(op, name, stamp)
    return op


def _reply(rank: int, ops, now: float = T0 + 20) -> RankReply:
    for op in ops:
        op.rank = rank
    return RankReply(
        rank, f"w{rank}", flight_record_pb2.FlightRecordResponse(rank=rank, ops=ops, now_s=now)
    )


def _snapshot(ranks=(0, 1, 2)) -> ClusterSnapshot:
    workers = tuple(
        WorkerInfo(
            rank=r, address=f"w{r}", state=WorkerState.READY, devices=["cpu"], hostname="h",
            pid=1, worker_id=f"id{r}", generation=3, last_heartbeat_age_s=0.3, backend="gloo",
            uptime_s=1.0, version="",
        )
        for r in ranks
    )  # fmt: skip
    return ClusterSnapshot(3, True, True, len(ranks), workers, 1, "ok", 8.0)


def _replies_of_a_finished_op() -> list[RankReply]:
    return [
        _reply(0, [_op(1, T0, T0 + 0.1, T0 + 0.2, T0 + 0.3)]),
        _reply(1, [_op(1, 0, T0 + 0.11, T0 + 0.25, T0 + 0.3)]),
        _reply(2, [_op(1, 0, T0 + 0.12, T0 + 0.22, T0 + 0.4)]),
    ]


def test_merge_joins_one_op_across_ranks_and_names_the_straggler() -> None:
    (op,) = merge(_replies_of_a_finished_op())
    assert (op.op_id, op.generation, op.outcome, op.names) == (1, 3, "ok", ("grads",))
    assert sorted(op.per_rank) == [0, 1, 2]
    assert op.per_rank[0].phase == "finished" and "admitted" not in op.per_rank[1].phases
    assert op.slowest_rank == 1


def test_the_trace_has_a_process_per_rank_and_a_flow_per_op() -> None:
    ops = merge(_replies_of_a_finished_op())
    events = trace_events(ops)["traceEvents"]
    assert all({"ph", "ts", "pid", "tid"} <= set(e) for e in events)
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        "rank 0", "rank 1", "rank 2"
    }  # fmt: skip
    flows = Counter(e["ph"] for e in events if e["ph"] in ("s", "t", "f"))
    assert flows == {"s": 1, "t": 1, "f": 1}
    bars = [e for e in events if e["ph"] == "X"]
    assert len(bars) == 1 + 3 * 2  # rank 0 queued, and every rank's two other phases
    assert all(e["dur"] >= 0 for e in bars)


def test_diagnose_names_the_rank_that_does_not_answer() -> None:
    replies = [
        _reply(0, [_op(7, T0, T0 + 1, T0 + 1.1, code=-1)]),
        _reply(1, [_op(7, 0, T0 + 1, T0 + 1.2, code=-1)]),
        RankReply(2, "w2", None, "DEADLINE_EXCEEDED: no answer"),
    ]
    record = FlightRecord(_snapshot(), tuple(replies), tuple(merge(replies)))
    (stuck,) = diagnose(record, threshold_s=2.0)
    assert stuck.waiting_on == (2,) and stuck.phase == "started"
    assert stuck.line.startswith("op 7 all_reduce 'grads' (generation 3): data phase for 18.")
    assert "rank 2 — not answering (heartbeat 0.3 s ago)" in stuck.line
    assert diagnose(record, threshold_s=30.0) == []


def test_diagnose_names_a_rank_behind_with_its_own_current_op() -> None:
    replies = [
        _reply(0, [_op(7, T0, T0 + 1, T0 + 1.1, code=-1)]),
        _reply(1, [_op(7, 0, T0 + 1, T0 + 1.2, code=-1)]),
        _reply(2, [_op(6, 0, T0, T0 + 0.5, code=-1)]),
    ]
    record = FlightRecord(_snapshot(), tuple(replies), tuple(merge(replies)))
    stuck = {s.op.op_id: s for s in diagnose(record, threshold_s=2.0)}
    assert stuck[7].waiting_on == (2,)
    assert "rank 2 — alive" in stuck[7].line
    assert "its current op: 6 all_reduce, still in its data phase" in stuck[7].line


def test_nothing_finished_is_stuck() -> None:
    replies = _replies_of_a_finished_op()
    record = FlightRecord(_snapshot(), tuple(replies), tuple(merge(replies)))
    assert diagnose(record, threshold_s=0.0) == []


def test_status_names_a_worker_that_says_it_is_stuck() -> None:
    snapshot = _snapshot()
    line = "op 7 all_reduce 'grads' (generation 3): data phase for 3.1 s on rank 0"
    stuck = dataclasses.replace(snapshot.workers[0], stuck=line)
    snapshot = dataclasses.replace(snapshot, workers=(stuck, *snapshot.workers[1:]))
    table = format_table("c:1", snapshot, width=200)
    assert f"stuck on w0: {line} (collectives diagnose)" in table
    assert snapshot.to_dict()["workers"][0]["stuck"] == line


def test_a_forward_is_recorded_as_a_call_and_merged_across_ranks_by_call_id() -> None:
    recorders = [FlightRecorder(4), FlightRecorder(4)]
    for rank, recorder in enumerate(recorders):
        now = time.monotonic()
        slot = recorder.open_call("forward", ("mlp",), "call-1", rank, 3, now, "peer")
        assert slot is not None
        slot.start_if_held(slot.seq, now + 0.001)
        slot.finish_if_held(slot.seq, now + 0.002, 0)
    (op,) = recorders[0].snapshot()
    assert (op.kind, op.names, op.call_id, op.op_id, op.ranks) == (
        "forward",
        ("mlp",),
        "call-1",
        0,
        (0,),
    )
    assert list(op.phases) == ["admitted", "started", "finished"]
    replies = []
    for rank, recorder in enumerate(recorders):
        reply = flight_record_pb2.FlightRecordResponse(rank=rank, generation=3)
        for o in recorder.snapshot():
            reply.ops.add(
                op_id=o.op_id, generation=o.generation, rank=o.rank, kind=o.kind,
                names=o.names, ranks=o.ranks, call_id=o.call_id, code=o.code,
                admitted_s=o.phases["admitted"], started_s=o.phases["started"],
                finished_s=o.phases["finished"],
            )  # fmt: skip
        replies.append(RankReply(rank, f"w{rank}", reply))
    (record,) = merge(replies)
    assert record.call_id == "call-1" and sorted(record.per_rank) == [0, 1]
    assert record.outcome == "ok" and record.label == "call call-1"


def test_a_call_that_outlives_the_ring_does_not_write_into_a_newer_op() -> None:
    recorder = FlightRecorder(2)
    now = time.monotonic()
    slow = recorder.open_call("forward", ("mlp",), "slow", 0, 3, now)
    assert slow is not None
    seq = slow.seq
    for op_id in (1, 2):  # the ring wraps: the slow call's slot now holds op 2
        slot = recorder.open(_desc(op_id), 0, [0, 1], now)
        assert slot is not None
    slow.finish_if_held(seq, now + 5, 0)
    ops = recorder.snapshot()
    assert [o.op_id for o in ops] == [1, 2] and all(o.in_flight for o in ops)


def test_a_record_is_bounded_in_bytes_and_says_what_it_left_out() -> None:
    """A coalesced op of 1,024 long names and a message naming each: the record keeps
    16 names and 1,024 characters, and counts the rest; a small descriptor is kept
    as it is (by reference: recording stays cheap)."""
    recorder = FlightRecorder(8)
    big = worker_pb2.OpDescriptor(op_id=7, generation=3, kind=OpKind.ALL_REDUCE_COALESCED)
    big.coalesced.names.extend(f"n/{i:04d}/" + "x" * 240 for i in range(1024))
    slot = recorder.open(big, 0, [0, 1], time.monotonic())
    assert slot is not None and slot.desc is not big
    slot.finish(time.monotonic(), 5, "missing: " + ", ".join(big.coalesced.names))
    small = _desc(8)
    kept = recorder.open(small, 0, [0, 1], time.monotonic())
    assert kept is not None and kept.desc is small
    call = recorder.open_call("forward", tuple(f"in/{i}" for i in range(40)), "c1", 0, 3, 0.0)
    assert call is not None
    op, small_op, forward = recorder.snapshot()
    assert (op.op_id, op.kind, op.code) == (7, "all_reduce_coalesced", 5)
    assert op.names == tuple(big.coalesced.names[:16]) and op.names_omitted == 1008
    full = "missing: " + ", ".join(big.coalesced.names)
    assert op.message == full[:1024] and op.message_omitted == len(full) - 1024
    assert small_op.names == ("x",) and small_op.names_omitted == 0
    assert len(forward.names) == 16 and forward.names_omitted == 24


def test_snapshot_pages_back_by_sequence_number() -> None:
    recorder = FlightRecorder(10)
    for op_id in range(1, 26):  # the ring holds ops 16..25 (sequence numbers 15..24)
        slot = recorder.open(_desc(op_id), 0, [0], time.monotonic())
        assert slot is not None
        slot.finish(time.monotonic(), 0)
    newest = recorder.snapshot(4)
    assert [op.op_id for op in newest] == [22, 23, 24, 25]
    assert [op.seq for op in newest] == [21, 22, 23, 24]
    assert recorder.held_before(newest[0].seq) == 6
    page = recorder.snapshot(4, before=newest[0].seq)
    assert [op.op_id for op in page] == [18, 19, 20, 21]
    rest = recorder.snapshot(0, before=page[0].seq)
    assert [op.op_id for op in rest] == [16, 17]
    assert recorder.held_before(rest[0].seq) == 0


def test_a_ring_too_big_for_one_answer_is_read_in_pages() -> None:
    """600 records of the largest kind (about 3 MiB): each answer stays under its byte
    budget, says how many older ops it left out, and the reader pages back to an
    answer holding every op, in order."""
    from types import SimpleNamespace

    from collectives.observe.flight_record import read_paged
    from collectives_server.worker.telemetry.flight_record import (
        RESPONSE_BYTES,
        flight_record_response,
    )

    recorder = FlightRecorder(2000)
    for op_id in range(1, 601):
        big = worker_pb2.OpDescriptor(op_id=op_id, generation=3, kind=OpKind.ALL_REDUCE_COALESCED)
        big.coalesced.names.extend(f"n/{op_id}/{i:04d}/" + "x" * 230 for i in range(64))
        slot = recorder.open(big, 0, [0, 1], time.monotonic())
        assert slot is not None
        slot.finish(time.monotonic(), 5, "y" * 5000)
    ctx = SimpleNamespace(
        runtime=None, worker_id="w1", address="127.0.0.1:1", recorder=recorder, op_timeout_s=60.0
    )
    asked: list[flight_record_pb2.FlightRecordRequest] = []

    class Stub:  # the worker's handler, called in-process
        def GetFlightRecord(self, request, timeout):  # noqa: N802 - the RPC's name
            asked.append(request)
            answer = flight_record_response(ctx, request.last, request.before_seq)
            assert answer.ByteSize() < RESPONSE_BYTES + 4096
            return answer

    first = Stub().GetFlightRecord(flight_record_pb2.FlightRecordRequest(), 5.0)
    assert 0 < len(first.ops) < 600 and first.older == 600 - len(first.ops)
    asked.clear()
    whole = read_paged(Stub(), 0, 5.0)
    assert [op.op_id for op in whole.ops] == list(range(1, 601))
    assert whole.older == 0 and len(asked) >= 2
    assert all(len(op.names) == 16 and op.names_omitted == 48 for op in whole.ops)
    assert all(op.message_chars_omitted == 5000 - 1024 for op in whole.ops)
    last = read_paged(Stub(), 450, 5.0)
    assert [op.op_id for op in last.ops] == list(range(151, 601))
