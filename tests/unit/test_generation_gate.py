"""A generation sealed by a drain forms its groups while the handoff runs, and takes
no step before it is opened (``GenerationSpec.gated``, ``Generation.open``): two real
generations (``generation_pair``) on gloo over loopback. A generation connects to its
rendezvous store on its own thread, so a store whose host is gone never holds up the
daemon that started it."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.distributed as dist
from generation_pair import TIMEOUT_S, Pair
from helpers import wait_until

from collectives.errors import CollectiveError
from collectives.reduce_ops import ReduceOp
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.engine.generation import (
    Generation,
    GenerationHooks,
    GenerationSpec,
)

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


def test_a_generation_connects_to_its_rendezvous_store_on_its_own_thread() -> None:
    """Whoever starts a generation (the daemon, under its lock) is never held up by the
    rendezvous store: the generation's thread connects, and a store that cannot be
    reached (its host gone) leaves a generation that did not form, stopped cleanly."""
    asked = threading.Event()
    release = threading.Event()

    def unreachable() -> dist.Store:
        asked.set()
        assert release.wait(TIMEOUT_S)
        raise dist.DistNetworkError("test: the store's host is gone")

    spec = GenerationSpec(
        generation=3,
        rank=1,
        world_size=2,
        tcp_store=unreachable,
        store=TensorStore(torch.device("cpu"), None),
        device=torch.device("cpu"),
        host="127.0.0.1",
        op_timeout_s=TIMEOUT_S,
        queue_size=4,
        rebuild_after_s=TIMEOUT_S,
    )
    joined = threading.Event()
    hooks = GenerationHooks(
        on_joined=lambda generation: joined.set(), on_op_done=lambda *args: None
    )
    generation = Generation(spec, hooks).start()  # returns while the connection waits
    assert asked.wait(TIMEOUT_S) and not release.is_set()
    release.set()
    wait_until(lambda: generation.failure, TIMEOUT_S, "the generation to give up forming")
    assert "could not form the process group" in generation.failure
    generation.stop(superseded_by=4)
    assert generation.finished.wait(TIMEOUT_S) and not joined.is_set()
