"""Which groups a generation builds again (``engine.carried_groups.carried``): after a
drain, the groups the members held (the successor holds none); after an epoch
rebuild, only those every rank held alike."""

from __future__ import annotations

from collectives_server.worker.engine.carried_groups import carried


def test_after_a_drain_the_members_groups_are_taken_and_the_successor_holds_none() -> None:
    tables = [{"3": [0, 2], "1": [0, 1]}, {}, {"1": [0, 1], "3": [0, 2]}]
    assert carried(tables, held_by_all=False) == [(1, [0, 1]), (3, [0, 2])]
    assert carried([{}, {}], held_by_all=False) == []


def test_after_an_epoch_rebuild_a_group_some_rank_lacks_or_holds_otherwise_is_dropped() -> None:
    # Group 4's new_group was cut short on rank 1; group 5 was destroyed on rank 2
    # only; group 6 names other ranks on rank 0 (never, but never kept either).
    tables = [
        {"1": [0, 2], "4": [1, 2], "5": [0, 1], "6": [0, 1]},
        {"1": [0, 2], "5": [0, 1], "6": [1, 2]},
        {"1": [0, 2], "4": [1, 2], "6": [0, 1]},
    ]
    assert carried(tables, held_by_all=True) == [(1, [0, 2])]
    assert carried([{}, {}, {}], held_by_all=True) == []
