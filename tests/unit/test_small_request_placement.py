"""Where a small request runs (``collectives.models.placement``): the power of two choices
over the load a client sees, and workers that failed a routed call left out a while."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from collectives.models import placement as _placement
from collectives.models.placement import Placement


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The placement's clock, standing still unless a test moves it: reports stay fresh
    however slowly a loaded machine runs the test."""
    now = [1000.0]
    monkeypatch.setattr(_placement.time, "monotonic", lambda: now[0])
    return now


def _members(n: int) -> list[Any]:
    return [SimpleNamespace(rank=r, address=f"127.0.0.1:{5000 + r}") for r in range(n)]


def test_parts_go_to_distinct_members() -> None:
    placement = Placement(seed=1)
    members = _members(3)
    for parts in (1, 2, 3):
        for _ in range(50):
            chosen = placement.choose(members, parts)
            assert len({w.address for w in chosen}) == parts
    with pytest.raises(ValueError):
        placement.choose(members, 4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_equal_loads_spread_evenly(world: int) -> None:
    placement = Placement(seed=world)
    members = _members(world)
    draws = 6000
    counts = Counter(placement.choose(members, 1)[0].rank for _ in range(draws))
    for rank in range(world):
        assert abs(counts[rank] - draws / world) < 0.1 * draws / world, counts


def test_the_less_loaded_of_two_is_taken() -> None:
    placement = Placement(seed=2)
    members = _members(2)
    placement.reported(members[0].address, 3)  # rank 0 said it had 3 others in flight
    assert {placement.choose(members, 1)[0].rank for _ in range(100)} == {1}
    with placement.sending([members[1].address] * 5):  # this client's 5 calls to rank 1
        assert {placement.choose(members, 1)[0].rank for _ in range(100)} == {0}
    assert {placement.choose(members, 1)[0].rank for _ in range(100)} == {1}


def test_with_many_members_a_busy_one_is_rarely_taken() -> None:
    placement = Placement(seed=3)
    members = _members(4)
    placement.reported(members[2].address, 10)
    counts = Counter(placement.choose(members, 1)[0].rank for _ in range(4000))
    # Rank 2 is taken only when both draws are rank 2: never, as the two differ.
    assert counts[2] == 0 and min(counts[r] for r in (0, 1, 3)) > 900, counts


def test_a_failed_worker_is_avoided_for_a_while(clock: list[float]) -> None:
    now = clock
    placement = Placement(seed=4)
    members = _members(3)
    placement.avoid(members[0].address)
    assert 0 not in {placement.choose(members, 1)[0].rank for _ in range(200)}
    assert {w.rank for w in placement.choose(members, 2)} == {1, 2}
    # More parts than usable members: every member is tried again.
    assert {w.rank for w in placement.choose(members, 3)} == {0, 1, 2}
    now[0] += _placement.AVOID_S + 0.1
    assert 0 in {placement.choose(members, 1)[0].rank for _ in range(200)}


def test_a_report_counts_only_while_fresh(clock: list[float]) -> None:
    """A worker that reported a burst is not held out of the choices after it."""
    placement = Placement(seed=5)
    members = _members(2)
    placement.reported(members[0].address, 4)
    assert {placement.choose(members, 1)[0].rank for _ in range(100)} == {1}
    clock[0] += _placement.REPORT_TTL_S + 0.001
    assert {placement.choose(members, 1)[0].rank for _ in range(200)} == {0, 1}
