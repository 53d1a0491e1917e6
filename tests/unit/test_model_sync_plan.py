"""What a generation's model exchange sends, from every rank's inventory (``plan_sync``)."""

from __future__ import annotations

from collectives_server.worker.engine.model_sync import HeldModel, SyncPlan, plan_sync


def _held(version: int, signature: int) -> HeldModel:
    return HeldModel(
        version=version,
        signature=signature,
        factory="collectives_server.model_zoo:mlp",
        kwargs_json="{}",
        archive_bytes=0,
        entries=[],
    )


def test_a_rank_without_the_model_gets_the_newest_version_of_the_lowest_holder() -> None:
    everyone = [{"m": _held(3, 7)}, {"m": _held(2, 7)}, {}]
    assert plan_sync(everyone) == [SyncPlan("m", 0, [1, 2], [2])]


def test_ranks_on_one_load_and_version_exchange_nothing() -> None:
    assert plan_sync([{"m": _held(1, 7)}, {"m": _held(1, 7)}]) == []


def test_a_rank_holding_another_load_is_left_to_the_load_on_its_way() -> None:
    """Two loads of one name (a load_model still reaching the ranks as a drain seals a
    generation) cannot say which is newer: the exchange used to rebuild the rank holding
    the newer one from the lowest rank's older one, and load_model had answered OK."""
    everyone = [{"m": _held(1, 7)}, {"m": _held(1, 9)}, {}]
    assert plan_sync(everyone) == [SyncPlan("m", 0, [2], [2])]
    assert plan_sync([{"m": _held(1, 7)}, {"m": _held(1, 9)}]) == []
