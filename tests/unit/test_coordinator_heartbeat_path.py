"""The membership's fast heartbeat path, checked against the rules as first written.

At 1 Hz from every worker, heartbeats are the coordinator's most frequent event,
so :class:`Membership` handles them in O(log N): a lease heap instead of a scan
for expiry, kept counts instead of scans for the status text, and the generation
decision only when an event or the clock can change it. ``ScanningMembership``
below puts the original O(N) versions of those pieces back (scan every worker,
decide after every event); random event sequences must give both the same
outcomes, errors and views, step by step.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives_server.coordinator import membership
from collectives_server.coordinator.membership import (
    LOST_KEEP_S,
    Membership,
    UnknownWorkerError,
)

LEASE = 5.0
SLOTS = 5  # distinct worker addresses in a sequence


class ScanningMembership(Membership):
    """The reference: every event scans every worker and reruns the full decision."""

    def _time_changes_decision(self, now: float) -> bool:
        return True

    def _live_count(self) -> int:
        return sum(1 for w in self._workers.values() if not w.lost)

    def _joining(self) -> int:
        return sum(
            1 for m in self._members if self._workers[m].joined_generation != self._generation
        )

    def _expire(self, now: float) -> list[str]:
        reasons = []
        for w in self._workers.values():
            if not w.lost and now - w.last_heartbeat > self.lease_s:
                self._mark_lost(w, now)
                reasons.append(
                    f"{w.worker_id} at {w.address} lost: no heartbeat for "
                    f"{now - w.last_heartbeat:.2f} s (lease {self.lease_s:g} s)"
                )
        return reasons


steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("advance"),
            st.sampled_from([0.0, 0.05, 0.3, 1.0, LEASE - 0.1, LEASE + 0.01, LOST_KEEP_S + 1]),
        ),
        st.tuples(st.just("register"), st.integers(0, SLOTS - 1), st.integers(0, 1)),
        st.tuples(
            st.just("heartbeat"),
            st.integers(0, SLOTS),  # SLOTS: an id nobody has
            st.sampled_from(["none", "current", "next", "stale"]),
            st.booleans(),
            st.sampled_from([None, "a", "b"]),
        ),
        st.tuples(st.just("leave"), st.integers(0, SLOTS)),
        st.tuples(st.just("tick")),
    ),
    max_size=80,
)


def _joined(m: Membership, choice: str) -> int:
    return {"none": 0, "current": m.generation, "next": m.generation + 1, "stale": 7}[choice]


def _apply(m: Membership, ids: dict[int, str], now: float, step: tuple) -> Any:
    """Runs one step; returns what it produced (outcome fields or the error)."""
    kind = step[0]
    try:
        if kind == "register":
            _, slot, pid = step
            worker_id, out = m.register(
                now, address=f"10.0.0.1:{5000 + slot}", pid=pid, devices=["cpu"]
            )
            ids[slot] = worker_id
            return worker_id, out
        if kind == "heartbeat":
            _, slot, joined, busy, status = step
            key = None if status is None else status.encode()
            return m.heartbeat(
                now,
                ids.get(slot, "nobody"),
                joined_generation=_joined(m, joined),
                busy=busy,
                status=status,
                status_key=key,
            )
        if kind == "leave":
            return m.leave(now, ids.get(step[1], "nobody"))
        return m.tick(now)
    except (UnknownWorkerError, ValueError) as exc:
        return type(exc).__name__, str(exc)


def _state(m: Membership, now: float) -> tuple:
    return (m.version, m.generation, m.formed, m.status, m.members, m.ready, m.view(now))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    min_workers=st.integers(1, 3),
    extra=st.integers(0, 2),
    window=st.sampled_from([0.0, 0.5]),
    refresh=st.sampled_from([0.5, 10.0]),
    script=steps,
)
def test_fast_path_matches_the_full_decision(
    min_workers: int, extra: int, window: float, refresh: float, script: list[tuple]
) -> None:
    def make(cls: type[Membership]) -> Membership:
        return cls(
            min_workers,
            min_workers + extra,
            lease_s=LEASE,
            join_window_s=window,
            id_prefix="t",
            status_refresh_s=refresh,
        )

    fast, full = make(Membership), make(ScanningMembership)
    fast_ids: dict[int, str] = {}
    full_ids: dict[int, str] = {}
    now = 0.0
    for i, step in enumerate(script):
        if step[0] == "advance":
            now += step[1]
            continue
        got, want = _apply(fast, fast_ids, now, step), _apply(full, full_ids, now, step)
        assert got == want, f"step {i} {step} at t={now}"
        assert _state(fast, now) == _state(full, now), f"after step {i} {step} at t={now}"


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of the membership's O(N) steps."""
    calls = {"_decide": 0, "_prune_lost": 0}
    decide, prune = Membership._decide, membership.prune_lost

    def counted_decide(self: Membership, *args: Any) -> Any:
        calls["_decide"] += 1
        return decide(self, *args)

    def counted_prune(*args: Any) -> Any:
        calls["_prune_lost"] += 1
        return prune(*args)

    monkeypatch.setattr(Membership, "_decide", counted_decide)
    monkeypatch.setattr(membership, "prune_lost", counted_prune)  # scans every LOST worker
    return calls


def test_steady_heartbeats_do_not_rerun_the_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 50
    m = Membership(n, n, lease_s=LEASE, join_window_s=0.5, id_prefix="t")
    ids = [m.register(0.0, address=f"10.0.0.1:{5000 + i}", devices=["cpu"])[0] for i in range(n)]
    assert m.formed
    m.tick(0.5)  # the join window ends: the clock alone may change a decision, once
    calls = _counting(monkeypatch)
    for beat in range(1, 4):  # joining the generation, then busy flips and new statuses
        for i, worker_id in enumerate(ids):
            now = beat + i / n
            out = m.heartbeat(
                now,
                worker_id,
                joined_generation=1,
                busy=(beat + i) % 2 == 0,
                status=f"s{beat}",
                status_key=f"k{beat}".encode(),
            )
            assert out.changed and not out.sealed
        m.tick(beat + 0.99)
    assert calls == {"_decide": 0, "_prune_lost": 0}
    assert m.ready and m.status == f"generation 1 ready with {n} workers"
    m.tick(4.0 + LEASE)  # every lease runs out at once: that is a decision
    assert calls["_decide"] == 1
    assert not m.formed and m.status == f"waiting for {n} more workers (0 live, min {n})"


def test_lease_heap_stays_bounded_and_correct_under_rapid_heartbeats() -> None:
    m = Membership(1, 2, lease_s=LEASE, join_window_s=0.0, id_prefix="t")
    a = m.register(0.0, address="10.0.0.1:5000", devices=["cpu"])[0]
    b = m.register(0.0, address="10.0.0.1:5001", devices=["cpu"])[0]
    for i in range(5000):  # far more renewals than workers: the heap is rebuilt on the way
        m.heartbeat(i * 1e-4, a)
    assert len(m._leases) <= 16 * 2 + 1024
    last = 4999 * 1e-4
    out = m.tick(LEASE + 0.01)  # b, silent since 0.0, is lost; a is not
    assert out.lost == (b,) and m.is_live(a) and not m.is_live(b)
    out = m.tick(last + LEASE + 0.01)
    assert out.lost == (a,)
