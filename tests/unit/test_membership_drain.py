"""Drains in the coordinator's membership rules: a rank handed to a spare (prepared,
then sealed), a shrink, and every way a handoff is called off, driven by an injected
clock."""

from __future__ import annotations

import pytest

from collectives_server.coordinator.drain_rules import PREPARE_MAX_S
from collectives_server.coordinator.membership import Membership, Outcome, WorkerState
from collectives_server.coordinator.vocabulary import DrainRefusedError, HandoffOutcome
from collectives_server.membership_digest import membership_digest

LEASE = 5.0
WINDOW = 0.5
TIMEOUT = 30.0


def cluster(
    members: int = 3, spares: int = 1, min_workers: int = 2
) -> tuple[Membership, list[str]]:
    """A formed membership of ``members`` (ranks in registration order) and ``spares``."""
    m = Membership(min_workers, members, lease_s=LEASE, join_window_s=WINDOW, id_prefix="t")
    ids = []
    for i in range(members + spares):
        address = f"127.0.0.1:{6000 + i}"
        worker_id, _ = m.register(0.0, address=address, pid=6000 + i, devices=["cpu"])
        ids.append(worker_id)
    assert m.formed and list(m.members) == ids[:members]
    for w in ids:
        m.heartbeat(0.1, w, joined_generation=m.generation if w in m.members else 0)
    assert m.ready
    return m, ids


def drain(m: Membership, now: float, worker: str, **kwargs: object) -> Outcome:
    """``m.drain``, then every member of the generation it prepares and the drained
    worker say they are ready (the last one seals it); a shrink is sealed at once."""
    outcome = m.drain(now, worker, **kwargs)  # type: ignore[arg-type]
    h = m.handoff
    if h is None or not h.preparing:
        return outcome
    digest = membership_digest(h.planned)
    for w in (h.drained, *h.planned):
        outcome = m.heartbeat(
            now, w, prepared_generation=h.generation_after, prepared_digest=digest
        )
    assert outcome.sealed and m.handoff is not None and not m.handoff.preparing
    return outcome


def state_of(m: Membership, worker_id: str, now: float = 1.0) -> WorkerState:
    return next(w.state for w in m.view(now).workers if w.worker_id == worker_id)


def done(m: Membership, worker_id: str, **fields: object) -> HandoffOutcome:
    assert m.handoff is not None
    return HandoffOutcome(generation_after=m.handoff.generation_after, ok=True, **fields)  # type: ignore[arg-type]


def test_a_drain_prepares_the_next_generation_then_seals_it_when_all_are_ready() -> None:
    m, (a, b, c, spare) = cluster()
    before = m.generation
    outcome = m.drain(1.0, b, timeout_s=TIMEOUT)
    assert outcome.changed and not outcome.sealed and m.generation == before
    h = m.handoff
    assert h is not None and h.preparing and h.planned == (a, spare, c)
    assert h.generation_after == before + 1 and h.prepare_by == 1.0 + PREPARE_MAX_S
    assert m.ready, "the current generation serves while the next one is prepared"
    digest = membership_digest(h.planned)
    # Readiness for another generation, for another membership of it (another drain's),
    # or from a worker neither in the plan nor drained, counts nothing.
    m.heartbeat(1.1, a, prepared_generation=before + 2, prepared_digest=digest)
    m.heartbeat(1.1, a, prepared_generation=before + 1, prepared_digest=membership_digest([a, b]))
    m.heartbeat(1.1, b, prepared_generation=before + 1, prepared_digest=membership_digest([a]))
    assert m.handoff.prepared == ()
    m.heartbeat(1.1, a, prepared_generation=before + 1, prepared_digest=digest)
    m.heartbeat(1.2, c, prepared_generation=before + 1, prepared_digest=digest)
    assert m.generation == before and m.handoff.prepared == (a, c)
    m.heartbeat(1.25, spare, prepared_generation=before + 1, prepared_digest=digest)
    # Every planned member is ready; the drained worker is not yet (a forward's graph
    # there still awaits its backward): no seal until it is.
    assert m.generation == before and not m.tick(1.26).sealed
    outcome = m.heartbeat(1.3, b, prepared_generation=before + 1, prepared_digest=digest)
    assert outcome.sealed and m.generation == before + 1 and m.members == (a, spare, c)
    assert m.handoff is not None and not m.handoff.preparing and m.handoff.formed_ahead
    # The record says so, for a worker that never sees the message of the seal.
    assert m.view(1.3).history[-1].formed_ahead == m.handoff.drain_id != ""
    m.handoff_result(2.0, spare, done(m, spare, tensors=1, bytes=8, seconds=0.5))
    report = m.drains[-1]
    assert (report.seconds, report.prepare_seconds) == pytest.approx((1.0, 0.3))


def test_a_drain_seals_its_generation_when_preparing_takes_too_long() -> None:
    m, (a, b, c, spare) = cluster()
    before = m.generation
    m.drain(1.0, b, timeout_s=4.0)  # (it prepares for half its time at most)
    assert m.handoff is not None and m.handoff.prepare_by == 3.0
    digest = membership_digest(m.handoff.planned)
    m.heartbeat(1.1, spare, prepared_generation=before + 1, prepared_digest=digest)
    assert not m.tick(2.9).sealed and m.generation == before
    outcome = m.tick(3.0)
    assert outcome.sealed and m.members == (a, spare, c)
    assert f"not prepared in 2 s: {sorted([a, b, c])}" in outcome.reason
    assert m.handoff is not None and not m.handoff.preparing and not m.handoff.formed_ahead
    assert m.view(3.0).history[-1].formed_ahead == ""


def test_a_drained_worker_not_ready_by_the_bound_delays_the_seal_no_further() -> None:
    """A forward's graph held on the drained worker past the preparation's bound (its
    client never ran the backward) does not stop the drain: the generation is sealed
    then, with the groups formed ahead (every planned member was ready)."""
    m, (a, b, c, spare) = cluster()
    before = m.generation
    m.drain(1.0, b, timeout_s=4.0)
    assert m.handoff is not None
    digest = membership_digest(m.handoff.planned)
    for w in (a, c, spare):
        m.heartbeat(1.1, w, prepared_generation=before + 1, prepared_digest=digest)
    assert not m.tick(2.9).sealed
    outcome = m.tick(3.0)
    assert outcome.sealed and f"not prepared in 2 s: {[b]}" in outcome.reason
    assert m.handoff is not None and m.handoff.formed_ahead


def test_a_member_lost_while_preparing_calls_the_drain_off_before_any_seal() -> None:
    m, (a, b, c, _spare) = cluster()
    before = m.generation
    m.drain(1.0, b, timeout_s=TIMEOUT)
    outcome = m.crashed(1.5, c, "gone")
    assert m.handoff is None and "before its generation was sealed" in outcome.reason
    report = m.drains[-1]
    assert report.error and report.generation_after == before
    # The loss itself re-forms as any crash does: the drained worker kept its rank.
    assert m.generation == before + 1 and m.members[:2] == (a, b) and c not in m.members
    assert state_of(m, b, 2.0) != WorkerState.DRAINING


def test_a_drain_puts_the_spare_in_the_rank_and_waits_for_its_report() -> None:
    m, (a, b, c, spare) = cluster()
    before = m.generation
    outcome = drain(m, 1.0, b, timeout_s=TIMEOUT)
    assert outcome.sealed and outcome.changed
    assert m.generation == before + 1 and m.members == (a, spare, c)
    h = m.handoff
    assert h is not None and (h.drained, h.successor, h.rank) == (b, spare, 1)
    assert (h.generation_before, h.generation_after) == (before, before + 1)
    assert not m.ready, "nobody may serve the new generation before the handoff ends"
    assert state_of(m, b) == WorkerState.DRAINING
    # A report from anyone but the successor changes nothing.
    assert not m.handoff_result(2.0, a, done(m, a)).changed
    m.handoff_result(2.5, spare, done(m, spare, tensors=3, bytes=4096, seconds=1.2))
    assert m.handoff is None
    report = m.drains[-1]
    assert (report.worker_id, report.successor_id, report.rank, report.error) == (b, spare, 1, "")
    assert (report.tensors_moved, report.bytes_moved, report.seconds) == (3, 4096, 1.5)
    assert m.view(3.0).history[-1].carried_over
    assert m.drains_completed == 1 and m.drain_bytes_total == 4096
    # The drained worker is never a candidate again; it leaves, and nothing is resealed.
    generation = m.generation
    assert not m.leave(3.0, b).sealed and m.generation == generation
    for w in (a, spare, c):
        m.heartbeat(3.1, w, joined_generation=generation)
    assert m.ready


def test_the_drained_worker_stays_out_while_it_is_live() -> None:
    m, (a, b, c, spare) = cluster()
    drain(m, 1.0, a, timeout_s=TIMEOUT)
    m.handoff_result(1.5, spare, done(m, spare))
    # c is lost: the next generation takes the survivors, not the drained worker.
    m.crashed(2.0, c, "gone")
    assert b in m.members and a not in m.members and len(m.members) == 2


@pytest.mark.parametrize("by", ["address", "id"])
def test_a_drain_names_its_worker_by_address_or_id(by: str) -> None:
    m, (_a, _b, c, _spare) = cluster()
    address = next(w.address for w in m.view(1.0).workers if w.worker_id == c)
    drain(m, 1.0, address if by == "address" else c, timeout_s=TIMEOUT)
    assert m.handoff is not None and m.handoff.drained == c


def test_refusals_change_nothing() -> None:
    m, (a, b, _c, spare) = cluster()
    version = m.version
    with pytest.raises(DrainRefusedError) as err:
        m.drain(1.0, "127.0.0.1:1", timeout_s=TIMEOUT)
    assert err.value.code == "not_found"
    with pytest.raises(DrainRefusedError, match="not a member") as err:
        m.drain(1.0, spare, timeout_s=TIMEOUT)
    assert err.value.code == "failed_precondition"
    drain(m, 1.0, a, timeout_s=TIMEOUT)
    with pytest.raises(DrainRefusedError, match="a drain is in progress"):
        m.drain(1.1, b, timeout_s=TIMEOUT)
    assert m.version > version  # (the first drain's seal)


def test_no_spare_is_a_failed_precondition_unless_shrink() -> None:
    m, (a, b, c) = cluster(spares=0)
    version, generation = m.version, m.generation
    with pytest.raises(DrainRefusedError, match="no spare is live") as err:
        m.drain(1.0, b, timeout_s=TIMEOUT)
    assert err.value.code == "failed_precondition"
    assert (m.version, m.generation) == (version, generation)
    drain(m, 1.0, b, shrink=True, timeout_s=TIMEOUT)
    assert m.members == (a, c) and m.handoff is not None and m.handoff.shrink
    # In a shrink the drained worker itself reports what it held.
    m.handoff_result(1.2, b, done(m, b, lost=("x", "y")))
    report = m.drains[-1]
    assert report.shrink and report.lost == ("x", "y") and report.successor_id == ""
    assert not m.view(2.0).history[-1].carried_over, "a shrink carries no rank over"


def test_a_shrink_below_min_workers_is_refused() -> None:
    m, (a, _b) = cluster(members=2, spares=0, min_workers=2)
    with pytest.raises(DrainRefusedError, match="below --min-workers"):
        m.drain(1.0, a, shrink=True, timeout_s=TIMEOUT)


def test_a_failed_handoff_gives_the_rank_back() -> None:
    m, (a, b, c, spare) = cluster()
    before = m.generation
    drain(m, 1.0, b, timeout_s=TIMEOUT)
    failed = HandoffOutcome(generation_after=before + 1, ok=False, error="disk on fire")
    outcome = m.handoff_result(2.0, spare, failed)
    assert outcome.sealed and m.handoff is None
    assert m.generation == before + 2 and m.members == (a, b, c)
    assert "disk on fire" in m.drains[-1].error
    history = m.view(2.0).history
    assert history[-1].carried_over and history[-2].carried_over, "no op ran in between"
    assert state_of(m, spare, 2.0) == WorkerState.SPARE


def test_the_successor_lost_mid_handoff_gives_the_rank_back() -> None:
    m, (a, b, c, spare) = cluster()
    drain(m, 1.0, c, timeout_s=TIMEOUT)
    m.crashed(1.5, spare, "gone")
    assert m.handoff is None and m.members == (a, b, c)
    assert "lost during the handoff" in m.drains[-1].error


def test_the_drained_worker_lost_mid_handoff_leaves_its_rank_empty() -> None:
    m, (a, b, c, spare) = cluster()
    drain(m, 1.0, b, timeout_s=TIMEOUT)
    generation = m.generation
    m.crashed(1.5, b, "gone")
    assert m.handoff is None and m.members == (a, spare, c) and m.generation == generation
    assert "the drained worker is gone" in m.drains[-1].error
    assert not m.view(2.0).history[-1].carried_over


def test_another_member_lost_mid_handoff_calls_it_off_without_that_member() -> None:
    m, (a, b, c, spare) = cluster()
    drain(m, 1.0, b, timeout_s=TIMEOUT)
    outcome = m.crashed(1.5, a, "gone")
    assert m.handoff is None and "called off" in outcome.reason
    # The call-off seals the survivors; the spare, no longer a successor, joins after.
    assert set(m.members) <= {b, c, spare} and m.members[:2] == (b, c)
    assert not any(r.carried_over for r in m.view(2.0).history[-2:]), "rank 0 was lost"


def test_a_handoff_that_runs_out_of_time_is_called_off() -> None:
    m, (a, b, c, spare) = cluster()
    drain(m, 1.0, b, timeout_s=2.0)
    for w in (a, b, c, spare):
        m.heartbeat(2.0, w)
    assert m.handoff is not None
    outcome = m.tick(3.0)
    assert outcome.sealed and m.handoff is None and m.members == (a, b, c)
    assert "did not end within 2 s" in m.drains[-1].error


def test_nothing_else_is_decided_while_a_handoff_runs() -> None:
    m, (_a, b) = cluster(members=2, spares=0, min_workers=1)
    drain(m, 1.0, b, shrink=True, timeout_s=TIMEOUT)
    generation = m.generation
    newcomer, _ = m.register(1.1, address="127.0.0.1:7000", pid=7000, devices=["cpu"])
    m.tick(1.1 + WINDOW + 0.1)
    assert m.generation == generation and newcomer not in m.members
    m.handoff_result(2.0, b, done(m, b))
    assert m.tick(2.0 + WINDOW).sealed or newcomer in m.members
