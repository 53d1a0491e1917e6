"""Who runs the leader's ops and how they are answered, on two real generations
(``generation_pair``).

Small ops run on the submitting thread while the leader's loop is idle
(``Generation.run_claimed``): a small op submitted to a parked loop is claimed,
runs on the caller's thread and gives torch's result; a large op never is; an
op submitted while another is claimed waits for it and runs after it on the
loop, in order; and a group that breaks under a claimed op fails that op as the
loop would, after which the generation rebuilds and runs ops again.

A fused run's outcomes are set together when the run ends
(``Generation._run_ops``): an op that finished before a later one raised
still gets its own result, never the error that ended the run. With ops
queued behind it, a run is answered once the next run is announced; with
none, before the loop waits for one (never only at its idle tick).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from generation_pair import TIMEOUT_S, Pair
from helpers import wait_until

from collectives.errors import CollectiveError, Reason, Unavailable
from collectives.reduce_ops import ReduceOp
from collectives_server.worker.engine.handlers.tensor_ops import INLINE_MAX_BYTES
from collectives_server.worker.engine.sequencer import Ticket

LOOP = "generation-1"  # the name of generation 1's loop thread
SUM = ReduceOp.SUM.wire


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(rebuild_after_s=1.0)
    yield p
    p.close()


def _put(pair: Pair, name: str, numel: int, gen: torch.Generator) -> list[torch.Tensor]:
    parts = [torch.randn(numel, generator=gen) for _ in pair.stores]
    for store, t in zip(pair.stores, parts, strict=True):
        store.put(name, t.clone())
    return parts


def _submit_to_parked_loop(pair: Pair, kind: str, before=None, **args) -> Ticket:
    """Submits with ``claim_if_idle`` at a moment the leader's loop is parked with nothing to
    do, checked under the generation's lock (so no idle tick can slip in between);
    ``before`` runs under that lock just before the submit."""
    leader = pair.generations[0]
    for _ in range(50):  # the loop parks again within a tick (1 s) of any wake-up
        wait_until(lambda: leader._seq.loop_parked, TIMEOUT_S, "the leader's loop to park")
        with leader._cond:  # re-entrant: submit takes it again
            if leader._seq.loop_parked:
                if before is not None:
                    before()
                return pair.submit(kind, claim_if_idle=True, **args)
    raise AssertionError("the leader's loop never stayed parked")


def _loop_waits_for_the_driver(pair: Pair) -> bool:
    """The leader's loop is awake (not parked) and waits inside ``_wait_for_op``."""
    loop = next(t for t in threading.enumerate() if t.name == LOOP)
    frame = sys._current_frames().get(loop.ident or -1)
    stack = []
    while frame is not None:
        stack.append(frame.f_code.co_name)
        frame = frame.f_back
    return (
        bool(stack)
        and stack[0] == "wait"
        and "_wait_for_op" in stack
        and not (pair.generations[0]._seq.loop_parked)
    )


def _follower_caught_up(pair: Pair) -> None:
    wait_until(lambda: len(pair.done[1]) == len(pair.done[0]), TIMEOUT_S, "the follower")


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
def test_a_small_op_on_a_parked_loop_runs_on_the_callers_thread_with_torchs_result(
    pair: Pair, kind: str
) -> None:
    gen = torch.Generator().manual_seed(11)
    parts = _put(pair, "x", 8, gen)
    target = "x" if kind == "broadcast" else "y"  # a broadcast has no out name
    args = {"root": 1} if kind == "broadcast" else {"out": "y", "op": SUM}
    ticket = _submit_to_parked_loop(pair, kind, name="x", **args)
    assert ticket.claimed
    pair.generations[0].run_claimed(ticket)
    assert ticket.future.done()  # set by run_claimed itself, before it returned
    result = ticket.future.result(0)
    assert pair.threads[0][-1] == threading.current_thread().name
    _follower_caught_up(pair)
    assert pair.threads[1][-1] == LOOP  # followers run every op on their loop
    expected = {
        "all_reduce": [parts[0] + parts[1]] * 2,
        "reduce_scatter": list((parts[0] + parts[1]).chunk(2)),
        "all_gather": [torch.stack(parts)] * 2,
        "broadcast": [parts[1]] * 2,
    }[kind]
    assert result.result_name == target
    for store, want in zip(pair.stores, expected, strict=True):
        assert torch.equal(store.peek(target), want)


def test_a_large_op_is_not_claimed_and_runs_on_the_loop(pair: Pair) -> None:
    gen = torch.Generator().manual_seed(12)
    parts = _put(pair, "big", INLINE_MAX_BYTES // 4 + 4, gen)
    ticket = _submit_to_parked_loop(pair, "all_reduce", name="big", op=SUM)
    assert not ticket.claimed
    ticket.future.result(TIMEOUT_S)
    assert pair.threads[0][-1] == LOOP
    _follower_caught_up(pair)
    for store in pair.stores:
        assert torch.equal(store.peek("big"), parts[0] + parts[1])


def test_an_op_submitted_while_one_is_claimed_waits_and_runs_after_it_on_the_loop(
    pair: Pair,
) -> None:
    gen = torch.Generator().manual_seed(13)
    parts = _put(pair, "c", 6, gen)
    first = _submit_to_parked_loop(pair, "all_reduce", name="c", op=SUM)
    assert first.claimed
    leader_store = pair.stores[0]
    leader_store.hold_commits = True  # the claimed op stops at the leader's commit
    driver = threading.Thread(target=pair.generations[0].run_claimed, args=(first,), name="driver")
    driver.start()
    assert leader_store.held.wait(TIMEOUT_S)
    second = pair.submit("all_reduce", claim_if_idle=True, name="c", op=SUM)
    assert not second.claimed  # one op at a time: the loop will run it
    # The submit woke the loop, which waits for the claimed op instead of taking it.
    wait_until(lambda: _loop_waits_for_the_driver(pair), TIMEOUT_S, "the loop to wait")
    assert not second.future.done() and not second.started
    leader_store.hold_commits = False
    leader_store.release.set()
    driver.join(TIMEOUT_S)
    assert not driver.is_alive()
    second.future.result(TIMEOUT_S)
    assert first.future.result(0).op_id < second.future.result(0).op_id
    assert pair.threads[0][-2:] == ["driver", LOOP]
    _follower_caught_up(pair)
    once = parts[0] + parts[1]
    for store in pair.stores:  # both sums, in order, on both ranks
        assert torch.equal(store.peek("c"), once + once)


def test_a_group_broken_under_a_claimed_op_fails_it_and_the_generation_rebuilds(
    pair: Pair,
) -> None:
    gen = torch.Generator().manual_seed(14)
    _put(pair, "b", 5, gen)
    follower = pair.generations[1]
    assert follower._channel is not None
    # The follower's control connection goes down while the leader's loop is parked:
    # only the claimed op can notice it.
    ticket = _submit_to_parked_loop(pair, "all_reduce", before=follower._channel.close, name="b")
    assert ticket.claimed
    leader = pair.generations[0]
    leader.run_claimed(ticket)
    error = ticket.future.exception(0)
    assert isinstance(error, Unavailable), error
    assert error.reason == str(Reason.PEER_LOST)
    assert "failed in generation 1" in str(error)
    assert not leader.ready.is_set()  # the epoch ended with the claimed op
    # Nobody runs an op in the broken epoch again: the next one waits for the group
    # to be rebuilt (after rebuild_after_s, 1 s) and then runs on the loop.
    parts = _put(pair, "after", 7, gen)
    queued = pair.submit("all_reduce", claim_if_idle=True, name="after", op=SUM)
    assert not queued.claimed
    queued.future.result(TIMEOUT_S)
    assert pair.threads[0][-1] == LOOP
    # Both ranks rebuilt the generation's group (epoch 1); claimed ops run again.
    assert leader.ready.is_set()
    wait_until(follower.ready.is_set, TIMEOUT_S, "the follower to rebuild its group")
    again = _submit_to_parked_loop(pair, "all_reduce", name="after", op=SUM)
    assert again.claimed
    leader.run_claimed(again)
    again.future.result(0)
    _follower_caught_up(pair)
    once = parts[0] + parts[1]
    for store in pair.stores:  # both sums, in order, on both ranks
        assert torch.equal(store.peek("after"), once + once)


def test_ops_that_finished_before_a_later_op_raised_keep_their_results(pair: Pair) -> None:
    gen = torch.Generator().manual_seed(21)
    names = [f"a{i}" for i in range(4)]
    parts = {n: [torch.randn(6, generator=gen) for _ in pair.stores] for n in names}
    for n in names:
        for store, t in zip(pair.stores, parts[n], strict=True):
            store.put(n, t.clone())
    leader = pair.stores[0]
    leader.hold_commits = True  # the loop stops at the first op's commit ...
    first = pair.submit("all_reduce", name="a0", op=SUM)
    assert leader.held.wait(TIMEOUT_S)
    # ... while three small ops on distinct names queue: one fused run once released.
    run = [pair.submit("all_reduce", name=n, op=SUM) for n in names[1:]]
    leader.fail_commits_of = "a2"  # the run's second op raises on the leader
    leader.hold_commits = False
    leader.release.set()
    first.future.result(TIMEOUT_S)
    answered = run[0].future.result(TIMEOUT_S)  # finished before a2 raised: its result
    assert answered.result_name == "a1"
    assert torch.equal(leader.peek("a1"), parts["a1"][0] + parts["a1"][1])
    for ticket in run[1:]:  # the op that raised and the one after it, in the same run
        error = ticket.future.exception(TIMEOUT_S)
        assert isinstance(error, CollectiveError), error
        assert error.code == grpc.StatusCode.INTERNAL
    assert torch.equal(leader.peek("a3"), parts["a3"][0])  # never ran on the leader
    # The run's error ended the epoch on the leader; both ranks rebuild the group
    # and the next op runs there.
    leader.fail_commits_of = None
    after = [torch.randn(3, generator=gen) for _ in pair.stores]
    for store, t in zip(pair.stores, after, strict=True):
        store.put("after", t.clone())
    pair.submit("all_reduce", name="after", op=SUM).future.result(TIMEOUT_S)
    assert torch.equal(leader.peek("after"), after[0] + after[1])


def test_a_run_is_answered_once_the_next_queued_run_is_announced(pair: Pair) -> None:
    gen = torch.Generator().manual_seed(33)
    a = _put(pair, "a", 6, gen)
    b = _put(pair, "b", 6, gen)
    leader = pair.generations[0]
    store = pair.stores[0]
    store.hold_commits = True  # the loop stops at the first op's commit ...
    first = pair.submit("all_reduce", name="a", op=SUM)
    assert store.held.wait(TIMEOUT_S)
    second = pair.submit("all_reduce", name="b", op=SUM)  # ... while the next one queues
    depth_at_answer: list[int] = []
    first.future.add_done_callback(lambda _: depth_at_answer.append(leader.queue_depth))
    store.hold_commits = False
    store.release.set()
    assert first.future.result(TIMEOUT_S).result_name == "a"
    # The second op had left the queue (taken and announced) before the first's answer.
    assert depth_at_answer == [0]
    assert second.future.result(TIMEOUT_S).result_name == "b"
    _follower_caught_up(pair)
    for name, parts in (("a", a), ("b", b)):
        for s in pair.stores:
            assert torch.equal(s.peek(name), parts[0] + parts[1])


def test_a_run_with_nothing_queued_is_answered_before_anything_else_is_announced(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(34)
    a = _put(pair, "a", 5, gen)
    sequencer = pair.generations[0]._seq
    events: list[str] = []
    announced = sequencer.announced

    def noting_announced() -> None:
        events.append("announced")
        announced()

    monkeypatch.setattr(sequencer, "announced", noting_announced)
    store = pair.stores[0]
    store.hold_commits = True
    ticket = pair.submit("all_reduce", name="a", op=SUM)  # on the loop, not claimed
    assert store.held.wait(TIMEOUT_S)
    before = len(events)  # the op's own announcement is in
    ticket.future.add_done_callback(lambda _: events.append("answered"))
    store.hold_commits = False
    store.release.set()
    assert ticket.future.result(TIMEOUT_S).result_name == "a"
    # Nothing was queued: the answer did not wait for the next announcement (the
    # idle tick, up to a tick away).
    wait_until(lambda: "answered" in events, TIMEOUT_S, "the answer's callback")
    assert events[before] == "answered", events[before:]
    _follower_caught_up(pair)
    assert torch.equal(pair.stores[1].peek("a"), a[0] + a[1])
