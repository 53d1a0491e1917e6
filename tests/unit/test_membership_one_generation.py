"""One generation number names one membership, in every role (hypothesis over events).

The membership rules are pure and take the clock as an argument, so hypothesis
drives them with arbitrary sequences of register / heartbeat / leave / tick
events at arbitrary times, in the three roles a coordinator plays:

* the **leader**, whose every changed state is recorded (``export_state``, as
  the servicer persists it to etcd) before anyone sees it;
* a **standby**, which serves a read-only copy of the last recorded state
  (``EtcdReplication.replica``: ``deciding=False``) and is ticked as a standby's
  clock would tick it;
* a **new leader** taking over from the last recorded state at any point
  (restore, then ``Membership.resume``).

Every state anyone could see is collected, and no generation number may name two
member lists. The digest each state shows must be its members' digest.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives_server.coordinator.admission import LeaseBook
from collectives_server.coordinator.ha.membership_state import export_state, restore_state
from collectives_server.coordinator.membership import Membership, UnknownWorkerError
from collectives_server.coordinator.vocabulary import DrainRefusedError, HandoffOutcome
from collectives_server.membership_digest import membership_digest

LEASE_S = 5.0
WINDOW_S = 0.5
UNIX_ZERO = 1_800_000_000.0  # the Unix time at monotonic 0 (any fixed value)

_event = st.one_of(
    st.tuples(st.just("register"), st.integers(0, 5)),
    st.tuples(st.just("heartbeat"), st.integers(0, 5)),
    st.tuples(st.just("join"), st.integers(0, 5)),
    st.tuples(st.just("leave"), st.integers(0, 5)),
    st.tuples(st.just("tick"), st.just(0)),
    st.tuples(st.just("standby_tick"), st.just(0)),
    st.tuples(st.just("take_over"), st.just(0)),
    st.tuples(st.just("drain"), st.integers(0, 5)),
    st.tuples(st.just("prepared"), st.integers(0, 5)),
    st.tuples(st.just("handoff_done"), st.just(0)),
)
_step = st.tuples(st.floats(0.0, 3.0), _event)


def _new(min_workers: int, max_workers: int, deciding: bool = True) -> Membership:
    return Membership(
        min_workers,
        max_workers,
        lease_s=LEASE_S,
        join_window_s=WINDOW_S,
        id_prefix="p",
        deciding=deciding,
    )


class _World:
    """The leader, its last recorded document, a standby copy, and what was seen."""

    def __init__(self, min_workers: int, max_workers: int) -> None:
        self.min_workers, self.max_workers = min_workers, max_workers
        self.leader = _new(min_workers, max_workers)
        self.leases = LeaseBook()
        self.doc = None
        self.standby: Membership | None = None
        self.ids: dict[int, str] = {}  # worker slot -> its current id
        self.seen: dict[int, tuple[str, ...]] = {}

    def see(self, m: Membership, now: float, who: str) -> None:
        view = m.view(now)
        if not view.formed:
            assert view.membership_digest == ""
            return
        members = tuple(w.worker_id for w in view.workers if w.rank >= 0)
        assert [w.rank for w in view.workers if w.rank >= 0] == list(range(len(members)))
        assert view.world_size == len(members)
        assert view.membership_digest == membership_digest(members), who
        first = self.seen.setdefault(view.generation, members)
        assert first == members, (
            f"{who} shows generation {view.generation} as {members}; it was seen as {first}"
        )

    def record(self, now: float) -> None:
        """The leader's state, recorded before anyone sees it (as with etcd)."""
        self.doc = export_state(self.leader, self.leases, now=now, unix_now=UNIX_ZERO + now)
        self.see(self.leader, now, "the leader")
        self.standby = _new(self.min_workers, self.max_workers, deciding=False)
        restore_state(
            self.doc,
            self.standby,
            LeaseBook(),
            now=now,
            unix_now=UNIX_ZERO + now,
        )
        self.see(self.standby, now, "a standby")

    def apply(self, now: float, kind: str, slot: int) -> None:
        m = self.leader
        outcome = None
        try:
            if kind == "register":
                worker_id, outcome = m.register(
                    now, address=f"127.0.0.1:{7000 + slot}", pid=100 + slot, devices=["cpu"]
                )
                self.ids[slot] = worker_id
            elif kind in ("heartbeat", "join") and slot in self.ids:
                joined = m.generation if kind == "join" and self.ids[slot] in m.members else 0
                outcome = m.heartbeat(now, self.ids[slot], joined_generation=joined)
            elif kind == "leave" and slot in self.ids:
                outcome = m.leave(now, self.ids.pop(slot))
            elif kind == "tick":
                outcome = m.tick(now)
            elif kind == "drain" and slot in self.ids:
                with contextlib.suppress(DrainRefusedError):
                    outcome = m.drain(now, self.ids[slot], timeout_s=4.0)
            elif kind == "prepared" and slot in self.ids and m.handoff is not None:
                after, digest = m.handoff.generation_after, membership_digest(m.handoff.planned)
                outcome = m.heartbeat(
                    now, self.ids[slot], prepared_generation=after, prepared_digest=digest
                )
            elif kind == "handoff_done" and m.handoff is not None and not m.handoff.preparing:
                h = m.handoff
                done = HandoffOutcome(generation_after=h.generation_after, ok=True)
                outcome = m.handoff_result(now, h.reporter, done)
            elif kind == "standby_tick" and self.standby is not None:
                before = self.standby.view(now)
                assert not self.standby.tick(now).changed
                after = self.standby.view(now)
                assert (after.generation, after.formed, after.membership_digest) == (
                    before.generation,
                    before.formed,
                    before.membership_digest,
                )
                with pytest.raises(RuntimeError):
                    self.standby.register(now, address="127.0.0.1:1", pid=1, devices=["cpu"])
                self.see(self.standby, now, "a ticked standby")
            elif kind == "take_over" and self.doc is not None:
                successor = _new(self.min_workers, self.max_workers)
                restore_state(
                    self.doc,
                    successor,
                    self.leases,
                    now=now,
                    unix_now=UNIX_ZERO + now,
                )
                self.see(successor, now, "a restored successor")
                self.leader = successor
                outcome = successor.resume(now, "took over")
        except UnknownWorkerError:
            self.ids.pop(slot, None)
            return
        if outcome is not None and outcome.changed:
            self.record(now)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    limits=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    steps=st.lists(_step, min_size=1, max_size=60),
)
def test_no_generation_number_names_two_memberships(limits, steps) -> None:
    min_workers, extra = limits
    world = _World(min_workers, min_workers + extra)
    now = 0.0
    for dt, (kind, slot) in steps:
        now += dt
        world.apply(now, kind, slot)


def test_a_standby_copy_of_two_live_workers_does_not_seal() -> None:
    """The reproduction in miniature: two of three registered, inside the join window."""
    leader = _new(2, 3)
    leases = LeaseBook()
    leader.register(0.0, address="127.0.0.1:7001", pid=1, devices=["cpu"])
    leader.register(0.1, address="127.0.0.1:7002", pid=2, devices=["cpu"])
    assert not leader.formed
    doc = export_state(leader, leases, now=0.1, unix_now=UNIX_ZERO + 0.1)
    standby = _new(2, 3, deciding=False)
    restore_state(doc, standby, LeaseBook(), now=0.2, unix_now=UNIX_ZERO + 0.2)
    assert not standby.formed and standby.generation == 0
    assert not standby.tick(5.0).changed and not standby.formed
    # A successor that takes over inside the window waits for it to end.
    successor = _new(2, 3)
    restore_state(doc, successor, leases, now=0.3, unix_now=UNIX_ZERO + 0.3)
    assert not successor.resume(0.3, "took over").sealed
    assert successor.tick(0.1 + WINDOW_S).sealed


def test_a_document_whose_digest_does_not_name_its_members_is_refused() -> None:
    leader = _new(2, 2)
    leases = LeaseBook()
    leader.register(0.0, address="127.0.0.1:7001", pid=1, devices=["cpu"])
    leader.register(0.0, address="127.0.0.1:7002", pid=2, devices=["cpu"])
    assert leader.formed
    doc = export_state(leader, leases, now=0.0, unix_now=UNIX_ZERO)
    doc["members"] = list(reversed(doc["members"]))
    with pytest.raises(ValueError, match="digest"):
        restore_state(doc, _new(2, 2, deciding=False), LeaseBook(), now=0, unix_now=UNIX_ZERO)


def test_a_drain_being_prepared_survives_a_takeover() -> None:
    """The plan, who is ready and the time left to prepare travel with the state: the
    new leader seals the same generation when the last member says it is ready."""
    leader = _new(2, 2)
    leases = LeaseBook()
    ids = [
        leader.register(0.0, address=f"127.0.0.1:{7001 + i}", pid=1 + i, devices=["cpu"])[0]
        for i in range(3)
    ]
    a, b, spare = ids
    generation = leader.generation
    leader.drain(0.1, a, timeout_s=4.0)
    digest = membership_digest([spare, b])
    leader.heartbeat(0.2, b, prepared_generation=generation + 1, prepared_digest=digest)
    leader.heartbeat(0.2, a, prepared_generation=generation + 1, prepared_digest=digest)
    doc = export_state(leader, leases, now=0.3, unix_now=UNIX_ZERO + 0.3)
    successor = _new(2, 2)
    restore_state(doc, successor, leases, now=10.0, unix_now=UNIX_ZERO + 0.5)
    h = successor.handoff
    assert h is not None and h.preparing and (h.planned, h.prepared) == ((spare, b), (b, a))
    assert h.prepare_by == pytest.approx(10.0 + (0.1 + 2.0 - 0.5), abs=1e-3)
    successor.resume(10.0, "took over")
    assert successor.generation == generation
    ready = successor.heartbeat(
        10.1, spare, prepared_generation=generation + 1, prepared_digest=digest
    )
    assert ready.sealed
    assert successor.members == (spare, b) and successor.generation == generation + 1
