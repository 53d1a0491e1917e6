"""The leader's op queue (``worker/engine/sequencer.py``) with a fake clock, no threads.

Admission (op ids, generation stamping, capacity, generation checks), FIFO
order, cancellation, deadlines of queued ops, idle ticks, draining and
closing; then a property-based test over random sequences of admit / cancel /
next / clock advances that checks the queue's invariants after every step.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine.sequencer import EpochEnd, Park, Sequencer, Ticket

GENERATION = 7
TIMEOUT_S = 10.0


class FakeClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def desc(kind: OpKind = OpKind.ALL_REDUCE, name: str = "x") -> worker_pb2.OpDescriptor:
    return worker_pb2.OpDescriptor(kind=kind, tensor=worker_pb2.TensorOpArgs(name=name))


def make(capacity: int = 4, tick_s: float = 1.0) -> tuple[Sequencer, FakeClock]:
    clock = FakeClock()
    return Sequencer(GENERATION, capacity, tick_s, clock), clock


def failure(ticket: Ticket) -> BaseException | None:
    assert ticket.future.done(), f"op {ticket.desc.op_id} is still pending"
    return ticket.future.exception(timeout=0)


def test_op_ids_increase_from_one_and_the_generation_is_stamped() -> None:
    seq, _ = make()
    tickets = [seq.admit(desc(), TIMEOUT_S) for _ in range(3)]
    assert [t.desc.op_id for t in tickets] == [1, 2, 3]
    assert all(t.desc.generation == GENERATION for t in tickets)
    assert seq.depth == 3
    assert not any(t.started or t.future.done() for t in tickets)


def test_next_returns_ops_in_admission_order_and_marks_them_started() -> None:
    seq, _ = make()
    names = ["a", "b", "c"]
    admitted = [seq.admit(desc(name=n), TIMEOUT_S) for n in names]
    taken = [seq.next() for _ in names]
    assert taken == admitted
    assert all(t is not None and t.started for t in taken)
    assert seq.next() is None
    assert seq.depth == 0


def test_a_full_queue_refuses_at_once_and_admits_again_once_one_is_taken() -> None:
    seq, _ = make(capacity=2)
    first = seq.admit(desc(), TIMEOUT_S)
    seq.admit(desc(), TIMEOUT_S)
    with pytest.raises(ResourceExhausted) as info:
        seq.admit(desc(), TIMEOUT_S)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.executed is False
    assert "2 ops" in info.value.message
    assert seq.depth == 2
    assert seq.next() is first
    third = seq.admit(desc(), TIMEOUT_S)
    assert third.desc.op_id == 3  # the refused admission consumed no op id
    assert seq.depth == 2


@pytest.mark.parametrize("expected", [GENERATION - 1, GENERATION + 1])
def test_a_different_expected_generation_is_refused_naming_both(expected: int) -> None:
    seq, _ = make()
    with pytest.raises(Unavailable) as info:
        seq.admit(desc(), TIMEOUT_S, expected_generation=expected)
    err = info.value
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert err.executed is False
    assert f"generation {expected}" in err.message
    assert f"at {GENERATION}" in err.message
    assert seq.depth == 0
    with pytest.raises(Unavailable):
        seq.check_generation(expected)


@pytest.mark.parametrize("expected", [0, GENERATION])
def test_zero_or_the_current_generation_is_accepted(expected: int) -> None:
    seq, _ = make()
    seq.check_generation(expected)
    ticket = seq.admit(desc(), TIMEOUT_S, expected_generation=expected)
    assert ticket.desc.generation == GENERATION
    assert seq.next() is ticket


def test_cancel_before_start_removes_the_op_and_after_start_returns_false() -> None:
    seq, _ = make()
    a, b, c = (seq.admit(desc(name=n), TIMEOUT_S) for n in "abc")
    assert seq.cancel(b) is True
    assert seq.depth == 2
    assert seq.cancel(b) is True  # cancelling twice is harmless
    assert seq.next() is a
    assert seq.cancel(a) is False  # started: it runs to its end
    assert seq.next() is c
    assert seq.next() is None
    assert not b.started


def test_an_op_whose_deadline_passed_while_queued_is_failed_and_skipped() -> None:
    seq, clock = make()
    late = seq.admit(desc(kind=OpKind.REDUCE), 1.0)
    on_time = seq.admit(desc(), 5.0)
    clock.advance(1.0)  # exactly at the first deadline: too late
    assert seq.next() is on_time
    err = failure(late)
    assert isinstance(err, DeadlineExceeded)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.executed is False
    assert "op 1 (reduce)" in err.message
    assert not late.started
    assert on_time.started and not on_time.future.done()


def test_every_expired_op_is_skipped_and_none_is_returned_when_all_expired() -> None:
    seq, clock = make()
    tickets = [seq.admit(desc(), 2.0) for _ in range(3)]
    clock.advance(2.5)
    assert seq.next() is None
    assert all(isinstance(failure(t), DeadlineExceeded) for t in tickets)
    assert seq.depth == 0


def test_tick_in_counts_down_with_the_clock_and_resets_on_announced() -> None:
    seq, clock = make(tick_s=2.0)
    assert seq.tick_in() == pytest.approx(2.0)
    clock.advance(0.5)
    assert seq.tick_in() == pytest.approx(1.5)
    clock.advance(2.0)
    assert seq.tick_in() == pytest.approx(-0.5)  # overdue: a tick is due now
    seq.announced()
    assert seq.tick_in() == pytest.approx(2.0)
    clock.advance(1.25)
    assert seq.tick_in() == pytest.approx(0.75)


def test_drain_fails_queued_ops_and_admission_stays_open() -> None:
    seq, _ = make()
    started = seq.admit(desc(), TIMEOUT_S)
    assert seq.next() is started
    queued = [seq.admit(desc(kind=OpKind.BROADCAST), TIMEOUT_S) for _ in range(2)]
    drained = seq.drain("the group broke")
    assert drained == queued
    assert seq.depth == 0
    assert not started.future.done()  # a started op is not the queue's to fail
    for t in queued:
        err = failure(t)
        assert isinstance(err, Unavailable)
        assert err.code == grpc.StatusCode.UNAVAILABLE
        assert err.executed is False
        assert f"op {t.desc.op_id} (broadcast)" in err.message
        assert "the group broke" in err.message
        assert "nothing was committed" in err.message
    assert not seq.closed
    again = seq.admit(desc(), TIMEOUT_S)
    assert again.desc.op_id == 4
    assert seq.next() is again


def test_close_with_a_successor_fails_queued_ops_and_refuses_later_admits() -> None:
    seq, _ = make()
    queued = [seq.admit(desc(), TIMEOUT_S) for _ in range(2)]
    successor = GENERATION + 1
    assert seq.close("retired", successor=successor) == queued
    assert seq.closed
    for t in queued:
        err = failure(t)
        assert isinstance(err, Unavailable)
        assert err.executed is False
        assert f"generation {GENERATION}" in err.message
        assert f"generation {successor}" in err.message
        assert "nothing was committed" in err.message
    with pytest.raises(Unavailable) as info:
        seq.admit(desc(), TIMEOUT_S)
    assert info.value.executed is False
    assert f"generation {GENERATION} is over" in info.value.message
    assert f"generation {successor}" in info.value.message
    assert seq.depth == 0
    assert seq.next() is None


def test_close_keeps_the_first_reason() -> None:
    seq, _ = make()
    seq.close("the group broke")
    seq.close("stopping", successor=GENERATION + 2)
    assert seq.closed_because == "the group broke"


# ------------------------------------------------------------ property-based
Step = tuple[str, float]
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.floats(0.5, 5.0)),  # the op's timeout
        st.tuples(st.just("cancel"), st.floats(0.0, 1.0)),  # which ticket (fraction)
        st.tuples(st.just("next"), st.just(0.0)),
        st.tuples(st.just("advance"), st.floats(0.0, 3.0)),
        st.tuples(st.just("drain"), st.just(0.0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 5), steps=STEPS)
def test_random_sequences_keep_the_queue_invariants(capacity: int, steps: list[Step]) -> None:
    seq, clock = make(capacity=capacity)
    admitted: list[Ticket] = []
    returned: list[Ticket] = []
    cancelled: set[int] = set()  # ids of tickets removed by cancel before they started
    for action, arg in steps:
        if action == "admit":
            try:
                admitted.append(seq.admit(desc(), arg))
            except ResourceExhausted:
                assert seq.depth == capacity
        elif action == "cancel" and admitted:
            ticket = admitted[min(int(arg * len(admitted)), len(admitted) - 1)]
            removed = seq.cancel(ticket)
            assert removed is (not ticket.started)
            if removed and not ticket.future.done():
                cancelled.add(id(ticket))
        elif action == "next":
            ticket = seq.next()
            if ticket is not None:
                assert ticket.started and not ticket.future.done()
                assert clock.now < ticket.deadline
                assert id(ticket) not in cancelled
                returned.append(ticket)
        elif action == "advance":
            clock.advance(arg)
        elif action == "drain":
            seq.drain("test")
        assert 0 <= seq.depth <= capacity
    while (ticket := seq.next()) is not None:
        returned.append(ticket)
    assert seq.depth == 0

    ids = [t.desc.op_id for t in admitted]
    assert ids == list(range(1, len(admitted) + 1))
    order = [t.desc.op_id for t in returned]
    assert order == sorted(set(order)), "next() must return each op once, in admission order"
    for ticket in admitted:
        outcomes = [
            ticket in returned,
            id(ticket) in cancelled,
            ticket.future.done() and ticket.future.exception(timeout=0) is not None,
        ]
        assert sum(outcomes) == 1, (ticket.desc.op_id, outcomes)
        if ticket in returned:
            assert ticket.started
        else:
            assert not ticket.started


def test_a_submitter_may_claim_its_op_only_from_a_parked_loop_with_nothing_else_queued() -> None:
    seq, _ = make()
    seq.open_epoch()
    first = seq.admit(desc(), TIMEOUT_S)
    assert not seq.may_claim(first) and not seq.claim(first)  # the loop takes it itself
    assert seq.next() is first
    seq.loop_parked = True
    alone = seq.admit(desc(), TIMEOUT_S)
    assert seq.may_claim(alone) and not alone.claimed  # asking claims nothing
    assert seq.claim(alone) and alone.claimed and seq.claimed
    second = seq.admit(desc(), TIMEOUT_S)  # while one is claimed: never a second
    assert not seq.claim(second) and not second.claimed
    assert seq.next() is alone  # the claimer takes its op as the loop would
    assert seq.cancel(second)
    assert not seq.release()  # parked with nothing queued: the loop sleeps on ...
    assert not seq.claimed
    third = seq.admit(desc(), TIMEOUT_S)
    assert seq.claim(third) and seq.next() is third
    seq.admit(desc(), TIMEOUT_S)
    assert seq.release()  # ... unless ops are queued for it ...
    seq.next()
    fourth = seq.admit(desc(), TIMEOUT_S)
    assert seq.claim(fourth) and seq.next() is fourth
    seq.loop_parked = False  # (its idle tick woke it: it waits for the claimer)
    assert seq.release()  # ... or it is awake


def test_a_claim_needs_the_op_alone_at_the_head_and_an_open_queue() -> None:
    seq, _ = make()
    seq.open_epoch()
    seq.loop_parked = True
    a, b = seq.admit(desc(), TIMEOUT_S), seq.admit(desc(), TIMEOUT_S)
    assert not seq.claim(a) and not seq.claim(b)  # two queued: the loop runs them
    seq.drain("test")
    c = seq.admit(desc(), TIMEOUT_S)
    seq.close("retired")
    assert not seq.claim(c)
    assert seq.release()  # closed: the loop must wake to stop


def test_no_claim_outside_an_epoch_and_none_after_a_claimed_op_ended_it() -> None:
    seq, _ = make()
    seq.loop_parked = True
    alone = seq.admit(desc(), TIMEOUT_S)
    assert not seq.claim(alone)  # no group formed yet: only the loop runs ops
    seq.open_epoch()
    assert seq.claim(alone) and seq.next() is alone
    seq.end_epoch("the group broke")
    assert seq.release()  # the loop must wake to rebuild
    later = seq.admit(desc(), TIMEOUT_S)
    assert not seq.claim(later)
    seq.open_epoch()  # the rebuilt epoch: claims again
    assert seq.epoch_end is None and seq.claim(later)


def test_the_loop_is_told_to_wait_end_the_epoch_run_or_tick() -> None:
    seq, clock = make()
    seq.open_epoch()
    assert seq.loop_next() == Park(seq.tick_s)  # nothing queued, the tick not due
    clock.advance(seq.tick_s)
    assert seq.loop_next() is None  # a tick is due
    seq.announced()
    queued = seq.admit(desc(), TIMEOUT_S)
    assert seq.loop_next() is queued and queued.started
    seq.loop_parked = True
    claimed = seq.admit(desc(), TIMEOUT_S)
    assert seq.claim(claimed)
    seq.loop_parked = False
    assert seq.loop_next() == Park(None)  # while a submitter runs its op
    seq.end_epoch(None)
    seq.release()
    assert seq.loop_next() == EpochEnd(None)
    seq.open_epoch()
    seq.close("retired")
    assert seq.loop_next() is None  # closed: the tick is a stop
