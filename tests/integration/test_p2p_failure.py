"""A worker lost while an ``exchange`` is in flight: the op fails on every rank
instead of hanging, nothing is committed (the survivors still hold what they held
before), and the survivors re-form and run the next exchange.

As in test_failure.py, the victim is stopped (SIGSTOP) before the op is submitted
and killed while the op waits on it, so the op is certainly in flight.
"""

from __future__ import annotations

import os
import signal

import grpc
import pytest
import torch
from helpers import LEASE_S, OP_TIMEOUT_S, make_input, put_each, wait_until
from launcher import stop_process

import collectives

REFORM_S = LEASE_S + 5.0


def _ready(cluster, size: int) -> list | None:
    members = sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)
    if cluster.world_size == size and all(w.state == "ready" for w in members):
        return members if len(members) == size else None
    return None


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), what


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_lost_during_a_ring_exchange_fails_it_everywhere_with_nothing_committed(
    fresh_cluster, gen
):
    local, cluster = fresh_cluster(3, "--min-workers", "2")
    members = wait_until(lambda: _ready(cluster, 3), 30, "3 ready workers")
    generation = cluster.generation
    victim = members[1].pid
    assert local.owns(victim), f"pid {victim} is not one of this cluster's processes"
    inputs = [
        make_input(dtype, (1 << 18,), gen) for dtype in (torch.float32, torch.int64, torch.float16)
    ]
    put_each(cluster, "ring", inputs)

    stop_process(victim)
    try:
        handle = cluster.exchange("ring", [(0, 1), (1, 2), (2, 0)], async_op=True, timeout=60)
        assert not handle.done(), "the exchange finished although a member is stopped"
    finally:
        os.kill(victim, signal.SIGKILL)

    exc = handle.exception(timeout=REFORM_S + OP_TIMEOUT_S)
    assert isinstance(exc, collectives.CollectiveError), f"expected a CollectiveError: {exc!r}"
    assert exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc

    wait_until(
        lambda: cluster.generation > generation and _ready(cluster, 2),
        REFORM_S + OP_TIMEOUT_S,
        "a new generation of 2 survivors",
    )
    # Each survivor by its address: a loaded machine may also evict a survivor whose
    # heartbeat was late, which then rejoins as a newcomer, after the other.
    rank_now = {w.address: w.rank for w in cluster.workers() if w.rank >= 0}
    survivors = {old_rank: rank_now[members[old_rank].address] for old_rank in (0, 2)}
    for old_rank, new_rank in survivors.items():  # nothing committed on either survivor
        _same(cluster.get("ring", rank=new_rank), inputs[old_rank], f"survivor {old_rank}")

    cluster.exchange("ring", [(0, 1), (1, 0)], timeout=30)
    for old_rank, new_rank in survivors.items():  # each now holds the other's
        other = 2 if old_rank == 0 else 0
        _same(cluster.get("ring", rank=new_rank), inputs[other], f"survivor {old_rank} swapped")
