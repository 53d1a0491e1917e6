"""A generation sealed by a drain forms its groups while the handoff runs, and takes
no step before it is opened (``GenerationSpec.gated``, ``Generation.open``): two real
generations (``generation_pair``) on gloo over loopback."""

from __future__ import annotations

import logging

import pytest
import torch
from generation_pair import TIMEOUT_S, Pair
from helpers import wait_until

from collectives.errors import CollectiveError
from collectives.reduce_ops import ReduceOp

SUM = ReduceOp.SUM.wire


def _formed(pair: Pair) -> bool:
    return all(g.groups[0].handles is not None for g in pair.generations)


def test_a_gated_generation_forms_its_groups_then_runs_nothing_until_opened() -> None:
    pair = Pair(gated=True)
    try:
        gen = torch.Generator().manual_seed(21)
        parts = [torch.randn(33, generator=gen) for _ in pair.stores]
        for store, t in zip(pair.stores, parts, strict=True):
            store.put("x", t.clone())
        ticket = pair.submit("all_reduce", name="x", op=SUM)  # admitted, queued
        wait_until(lambda: _formed(pair), TIMEOUT_S, "the groups to form while gated")
        # Formed, yet no rank joined and the queued op has not run: both wait for open().
        assert not any(j.is_set() for j in pair.joined)
        assert not ticket.future.done() and pair.done == [[], []]
        assert all(torch.equal(s.peek("x"), t) for s, t in zip(pair.stores, parts, strict=True))
        for g in pair.generations:
            g.open()
        ticket.future.result(TIMEOUT_S)
        wait_until(lambda: len(pair.done[1]) == 1, TIMEOUT_S, "the follower's step")
        assert all(j.is_set() for j in pair.joined)
        for store in pair.stores:
            assert torch.equal(store.peek("x"), parts[0] + parts[1])
    finally:
        pair.close()


def test_a_gated_generation_retired_before_it_opens_runs_nothing_and_warns_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The drain was called off: another generation replaces this one before its first
    step. Its queued op fails as never run, and nothing says its group broke."""
    pair = Pair(gated=True)
    store = pair.stores[0]
    store.put("x", torch.randn(5))
    ticket = pair.submit("all_reduce", name="x", op=SUM)
    wait_until(lambda: _formed(pair), TIMEOUT_S, "the groups to form while gated")
    with caplog.at_level(logging.WARNING, logger="collectives_server.worker.engine.generation"):
        for g in pair.generations:
            g.stop(superseded_by=2)
        for g in pair.generations:
            assert g.finished.wait(TIMEOUT_S)
    with pytest.raises(CollectiveError) as failed:
        ticket.future.result(TIMEOUT_S)
    assert failed.value.executed is False, failed.value.fields()
    assert pair.done == [[], []] and not any(j.is_set() for j in pair.joined)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
