"""The coordinator's membership rules, driven by an injected clock (no sleeps, no network)."""

from __future__ import annotations

import pytest

from collectives_server.coordinator.membership import (
    LOST_KEEP_COUNT,
    LOST_KEEP_S,
    InvalidRequestError,
    Membership,
    UnknownWorkerError,
    WorkerState,
)

LEASE = 5.0
WINDOW = 0.5


def make(min_workers: int = 2, max_workers: int = 4) -> Membership:
    return Membership(min_workers, max_workers, lease_s=LEASE, join_window_s=WINDOW, id_prefix="t")


def register(m: Membership, now: float, port: int) -> str:
    worker_id, _ = m.register(now, address=f"127.0.0.1:{port}", pid=port, devices=["cpu"])
    return worker_id


def ranks(m: Membership, now: float) -> dict[str, int]:
    return {w.worker_id: w.rank for w in m.view(now).workers}


def states(m: Membership, now: float) -> dict[str, WorkerState]:
    return {w.worker_id: w.state for w in m.view(now).workers}


# ---------------------------------------------------------------- first generation


def test_first_generation_seals_at_min_after_join_window() -> None:
    m = make(min_workers=2, max_workers=4)
    a = register(m, 0.0, 5001)
    assert m.status == "waiting for 1 more worker (1 live, min 2)"
    b = register(m, 0.1, 5002)
    assert m.generation == 0 and not m.formed
    assert m.tick(0.1 + WINDOW - 0.01).sealed is False
    outcome = m.tick(0.1 + WINDOW)
    assert outcome.sealed and "join window passed" in outcome.reason
    assert m.generation == 1 and m.formed and m.members == (a, b)
    view = m.view(1.0)
    assert view.world_size == 2 and [w.rank for w in view.workers] == [0, 1]
    assert all(w.state is WorkerState.JOINING for w in view.workers)
    assert not view.ready


def test_late_registration_restarts_the_join_window() -> None:
    m = make(min_workers=2, max_workers=4)
    register(m, 0.0, 5001)
    register(m, 0.0, 5002)
    register(m, 0.4, 5003)
    assert not m.tick(0.6).sealed  # window counts from the last registration
    assert m.tick(0.9).sealed
    assert m.view(1.0).world_size == 3


def test_first_generation_seals_at_once_at_max() -> None:
    m = make(min_workers=1, max_workers=3)
    ids = [register(m, 0.0, 5001 + i) for i in range(2)]
    assert not m.formed  # min reached, window not passed
    worker_id, outcome = m.register(0.0, address="127.0.0.1:5003", devices=["cpu"])
    assert outcome.sealed and "max_workers reached" in outcome.reason
    assert m.members == (*ids, worker_id)
    assert m.generation == 1


def test_workers_beyond_max_wait_as_spares() -> None:
    m = make(min_workers=2, max_workers=2)
    a, b = register(m, 0.0, 5001), register(m, 0.0, 5002)
    c = register(m, 0.1, 5003)
    m.tick(5.0 - 0.01)
    assert m.members == (a, b)
    assert ranks(m, 1.0)[c] == -1 and states(m, 1.0)[c] is WorkerState.SPARE
    assert "1 waiting to join (max 2)" in m.status
    m.leave(1.5, a)  # a member leaves: the spare takes its place
    assert m.members == (b, c) and states(m, 1.5)[c] is WorkerState.JOINING


def test_ready_busy_and_joining_states() -> None:
    m = make(min_workers=2, max_workers=2)
    a, b = register(m, 0.0, 5001), register(m, 0.0, 5002)
    assert m.generation == 1
    m.heartbeat(0.2, a, joined_generation=1)
    assert states(m, 0.2) == {a: WorkerState.READY, b: WorkerState.JOINING}
    assert not m.view(0.2).ready and "1 joining" in m.status
    m.heartbeat(0.3, b, joined_generation=1, busy=True)
    view = m.view(0.3)
    assert view.ready and m.status == "generation 1 ready with 2 workers"
    assert states(m, 0.3) == {a: WorkerState.READY, b: WorkerState.BUSY}


# ---------------------------------------------------------------- failures


def test_member_loss_reseals_with_survivors_in_order() -> None:
    m = make(min_workers=2, max_workers=4)
    a, b, c, d = (register(m, 0.0, 5001 + i) for i in range(4))
    assert m.members == (a, b, c, d)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        for w in (a, c, d):
            m.heartbeat(t, w, joined_generation=1)
    outcome = m.tick(5.01)  # b last heard at 0.0
    assert outcome.sealed and f"{b} at 127.0.0.1:5002 lost" in outcome.reason
    assert m.generation == 2 and m.members == (a, c, d)
    assert ranks(m, 5.01) == {a: 0, c: 1, d: 2, b: -1}
    assert states(m, 5.01)[b] is WorkerState.LOST
    # Old rank 0 lost: the lowest surviving old rank becomes rank 0.
    m.leave(6.0, a)
    assert m.generation == 3 and m.members == (c, d)
    assert a not in ranks(m, 6.0)  # left, not lost: gone from the listing


def test_loss_takes_waiting_newcomers_after_survivors() -> None:
    m = make(min_workers=2, max_workers=2)
    a, b = register(m, 0.0, 5001), register(m, 0.0, 5002)
    c, d = register(m, 1.0, 5003), register(m, 1.1, 5004)
    m.leave(2.0, a)
    assert m.generation == 2 and m.members == (b, c)  # capped at max; d still waits
    assert ranks(m, 2.0)[d] == -1


def test_below_min_waits_then_reforms_when_a_worker_joins() -> None:
    m = make(min_workers=3, max_workers=3)
    a, b, c = (register(m, 0.0, 5001 + i) for i in range(3))
    assert m.generation == 1
    outcome = m.leave(1.0, b)
    assert not outcome.sealed and "broken" in outcome.reason
    assert not m.formed and m.generation == 1 and m.members == ()
    assert m.status == "waiting for 1 more worker (2 live, min 3)"
    view = m.view(1.0)
    assert view.world_size == 0 and not view.ready
    assert {w.rank for w in view.workers} == {-1}
    d = register(m, 2.0, 5004)
    # Three live workers again: max reached, so no join window; survivors first.
    assert m.formed and m.generation == 2 and m.members == (a, c, d)


def test_below_min_reform_waits_for_join_window_below_max() -> None:
    m = make(min_workers=2, max_workers=4)
    a, b = register(m, 0.0, 5001), register(m, 0.0, 5002)
    m.tick(WINDOW)
    m.leave(1.0, a)
    assert not m.formed and m.generation == 1
    c = register(m, 2.0, 5003)
    assert not m.formed and "sealing generation 2 after the join window" in m.status
    assert m.tick(2.0 + WINDOW).sealed
    assert m.generation == 2 and m.members == (b, c)


def test_formed_cluster_takes_newcomers_after_join_window() -> None:
    m = make(min_workers=2, max_workers=4)
    a, b = register(m, 0.0, 5001), register(m, 0.0, 5002)
    m.tick(WINDOW)
    c = register(m, 3.0, 5003)
    assert m.generation == 1
    assert not m.tick(3.0 + WINDOW - 0.001).sealed
    outcome = m.tick(3.0 + WINDOW)
    assert outcome.sealed and "1 newcomer joined" in outcome.reason
    assert m.generation == 2 and m.members == (a, b, c)


def test_lease_expiry_boundaries() -> None:
    m = make(min_workers=1, max_workers=1)
    a = register(m, 0.0, 5001)
    m.heartbeat(1.0, a)
    m.tick(1.0 + LEASE)  # exactly lease_s of silence: still alive
    assert states(m, 1.0 + LEASE)[a] is not WorkerState.LOST
    m.heartbeat(1.0 + LEASE, a)  # renews at the boundary
    m.tick(1.0 + 2 * LEASE)
    assert states(m, 1.0 + 2 * LEASE)[a] is not WorkerState.LOST
    m.tick(1.0 + 2 * LEASE + 1e-6)
    assert states(m, 2 * LEASE + 2)[a] is WorkerState.LOST
    assert not m.formed


def test_late_heartbeat_is_not_found_even_before_a_tick() -> None:
    m = make(min_workers=1, max_workers=2)
    a = register(m, 0.0, 5001)
    version = m.version
    with pytest.raises(UnknownWorkerError, match="declared lost"):
        m.heartbeat(LEASE + 0.1, a)
    assert states(m, LEASE + 0.1)[a] is WorkerState.LOST
    assert m.version > version


def test_unknown_and_lost_workers_get_not_found() -> None:
    m = make()
    with pytest.raises(UnknownWorkerError, match="register again"):
        m.heartbeat(0.0, "nope")
    with pytest.raises(UnknownWorkerError):
        m.leave(0.0, "nope")


def test_rejoin_after_lost_gets_new_id_and_joins_as_newcomer() -> None:
    m = make(min_workers=2, max_workers=3)
    a, b, c = (register(m, 0.0, 5001 + i) for i in range(3))
    for t in (2.0, 4.0):
        m.heartbeat(t, b)
        m.heartbeat(t, c)
    outcome = m.heartbeat(6.0, b)  # every event applies lease expiry first
    assert outcome.sealed and f"{a} at 127.0.0.1:5001 lost" in outcome.reason
    m.heartbeat(6.0, c)
    assert m.generation == 2 and m.members == (b, c)
    with pytest.raises(UnknownWorkerError):
        m.heartbeat(6.5, a)
    a2, outcome = m.register(7.0, address="127.0.0.1:5001", pid=5001, devices=["cpu"])
    assert a2 != a and outcome.changed
    m.tick(7.0 + WINDOW)
    assert m.generation == 3 and m.members == (b, c, a2)
    assert states(m, 7.5)[a] is WorkerState.LOST  # the old record stays listed


def test_retried_registration_is_idempotent_and_restart_replaces() -> None:
    m = make(min_workers=2, max_workers=2)
    a = register(m, 0.0, 5001)
    version = m.version
    again, outcome = m.register(0.1, address="127.0.0.1:5001", pid=5001, devices=["cpu"])
    assert again == a and not outcome.changed and m.version == version
    fresh, outcome = m.register(0.2, address="127.0.0.1:5001", pid=9999, devices=["cpu"])
    assert fresh != a and "replaced" in outcome.reason
    assert states(m, 0.2)[a] is WorkerState.LOST


# ---------------------------------------------------------------- generation and version


def test_generation_changes_only_on_membership_changes() -> None:
    m = make(min_workers=2, max_workers=2)
    a, b = register(m, 0.0, 5001), register(m, 0.0, 5002)
    assert m.generation == 1
    for t in range(1, 20):
        m.heartbeat(float(t) / 4, a, joined_generation=1, busy=t % 2 == 0)
        m.heartbeat(float(t) / 4, b, joined_generation=1)
        m.tick(float(t) / 4)
    assert m.generation == 1
    m.leave(5.0, b)
    assert m.generation == 1 and not m.formed  # below min: no seal, no new number
    register(m, 5.5, 5003)
    assert m.generation == 2


def test_version_bumps_on_visible_changes_only() -> None:
    m = make(min_workers=2, max_workers=2)
    v0 = m.version
    assert v0 >= 1  # WatchCluster(after_version=0) sees the initial state
    a = register(m, 0.0, 5001)
    v1 = m.version
    assert v1 > v0
    b = register(m, 0.0, 5002)
    v2 = m.version
    assert v2 > v1
    assert not m.heartbeat(0.5, a).changed  # mere renewal
    assert not m.tick(0.6).changed
    assert m.version == v2
    assert m.heartbeat(0.7, a, joined_generation=1).changed  # a becomes READY
    v3 = m.version
    assert v3 > v2
    assert not m.heartbeat(0.8, a, joined_generation=1).changed
    assert m.heartbeat(0.9, a, joined_generation=1, busy=True).changed  # BUSY
    assert m.heartbeat(1.0, b, joined_generation=1).changed  # cluster becomes ready
    v4 = m.version
    assert m.view(1.0).version == v4 and m.view(1.0).ready
    assert m.tick(1.0 + LEASE + 0.1).changed  # both lost
    assert m.version > v4


def test_lost_workers_are_pruned_by_count_and_age() -> None:
    m = make(min_workers=1, max_workers=100)
    n = LOST_KEEP_COUNT + 4
    for i in range(n):
        register(m, float(i) * 0.001, 6000 + i)
    m.tick(LEASE + 1.0)
    lost = [w for w in m.view(LEASE + 1.0).workers if w.state is WorkerState.LOST]
    assert len(lost) == LOST_KEEP_COUNT
    assert m.tick(LEASE + 1.0 + LOST_KEEP_S + 1.0).changed
    assert m.view(LEASE + 2.0 + LOST_KEEP_S).workers == ()


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("address", ["", "host", "host:", ":5000", "host:http", "host:70000"])
def test_register_rejects_bad_addresses(address: str) -> None:
    with pytest.raises(InvalidRequestError, match="HOST:PORT"):
        make().register(0.0, address=address, devices=["cpu"])


def test_register_rejects_missing_devices_and_defaults_backend() -> None:
    m = make()
    with pytest.raises(InvalidRequestError, match="devices"):
        m.register(0.0, address="h:1", devices=[])
    m.register(0.0, address="h:1", devices=["cuda:0"])
    m.register(0.0, address="h:2", devices=["cpu"])
    assert [w.backend for w in m.view(0.0).workers] == ["nccl", "gloo"]


def test_heartbeat_with_unknown_generation_still_renews_the_lease() -> None:
    m = make(min_workers=1, max_workers=1)
    a = register(m, 0.0, 5001)
    outcome = m.heartbeat(4.0, a, joined_generation=7)  # e.g. from before a coordinator restart
    assert "generation 7 is unknown here, counted as 0" in outcome.reason
    m.tick(4.0 + LEASE)
    view = m.view(4.0 + LEASE)
    assert view.workers[0].state is WorkerState.JOINING and view.workers[0].joined_generation == 0


def test_initial_version_is_honoured() -> None:
    m = Membership(1, 1, initial_version=1_700_000_000_000_000)
    assert m.version == 1_700_000_000_000_000
    m.register(0.0, address="h:1", devices=["cpu"])
    assert m.version > 1_700_000_000_000_000


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_workers"):
        Membership(0, 1)
    with pytest.raises(ValueError, match="max_workers"):
        Membership(3, 2)


def _ticking(m: Membership, start: float, end: float, every: float = 0.25) -> None:
    """The daemon's ticker deciding every ``every`` seconds from ``start`` to ``end``."""
    t = start
    while t <= end:
        m.tick(t)
        t += every


def test_a_pause_of_the_coordinator_restarts_every_lease_instead_of_evicting() -> None:
    """A coordinator stopped (or starved) for longer than a lease finds, when it runs
    again, workers whose heartbeats it could not read: none is declared lost for that
    silence; each lease starts again, and a worker that then stays silent is lost."""
    m = Membership(2, 2, lease_s=LEASE, join_window_s=WINDOW, id_prefix="t", pause_s=1.0)
    a, b = register(m, 0.0, 5001), register(m, 0.0, 5002)
    generation = m.generation
    _ticking(m, 0.0, 2.0)
    m.heartbeat(2.0, a)
    m.heartbeat(2.0, b)
    # The coordinator does not run from 2.0 to 2.0 + 3 leases; its next decision is a
    # heartbeat that waited meanwhile.
    resumed = 2.0 + 3 * LEASE
    m.heartbeat(resumed, a)
    assert all(s is not WorkerState.LOST for s in states(m, resumed).values())
    assert m.generation == generation and m.events["coordinator_pauses"] == 1
    # From here time counts again: b, silent for a whole lease while the ticker runs, is lost.
    _ticking(m, resumed, resumed + LEASE + 0.5)
    assert states(m, resumed + LEASE + 0.5)[b] is WorkerState.LOST
    assert m.events["coordinator_pauses"] == 1


def test_without_pause_s_a_jump_of_the_clock_is_silence() -> None:
    """A caller that moves the clock by hand (pause_s None) gets the plain lease rule."""
    m = make(min_workers=1, max_workers=1)
    a = register(m, 0.0, 5001)
    m.tick(3 * LEASE)
    assert states(m, 3 * LEASE)[a] is WorkerState.LOST
    assert m.events["coordinator_pauses"] == 0
