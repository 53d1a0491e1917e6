"""``collectives-server local`` heals: a killed worker is restarted and the cluster
re-forms at full size, with the survivors' tensors intact."""

from __future__ import annotations

import logging
import os
import random
import signal
import time

import pytest
import torch
from helpers import wait_until

log = logging.getLogger(__name__)

pytestmark = pytest.mark.timeout(180)

RECOVER_BOUND_S = 10.0


def _ready_members(client, size: int, after_generation: int):
    members = sorted((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
    if (
        client.generation > after_generation
        and len(members) == size
        and all(w.state == "ready" for w in members)
    ):
        return members
    return None


def test_a_killed_worker_is_restarted_and_the_cluster_is_back_at_full_size(
    fresh_cluster, gen
) -> None:
    local, client = fresh_cluster(3, "--max-restarts", "2")
    members = sorted((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
    stored = {w.address: torch.randn(129, 7, generator=gen) for w in members}
    for w in members:
        client.put("kept", stored[w.address], rank=w.rank)
    victim = random.Random(int(gen.initial_seed())).choice(members)
    generation = client.generation
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    back = wait_until(
        lambda: _ready_members(client, 3, generation), 30, "the cluster back at world size 3"
    )
    recovered_s = time.monotonic() - killed
    log.info(f"killed rank {victim.rank}: back at world size 3 after {recovered_s:.2f} s")
    assert recovered_s < RECOVER_BOUND_S, f"back at world 3 after {recovered_s:.1f} s"
    newcomer = [w for w in back if w.address not in stored]
    assert len(newcomer) == 1 and newcomer[0].pid != victim.pid
    by_address = {w.address: w.rank for w in back}
    for address, tensor in stored.items():
        if address != victim.address:
            assert torch.equal(client.get("kept", rank=by_address[address]), tensor)
    # The healed cluster computes: an all_reduce over all three, checked against torch.
    parts = [torch.randn(33, generator=gen) for _ in back]
    for w, t in zip(back, parts, strict=True):
        client.put("x", t, rank=w.rank)
    client.all_reduce("x", out="x_sum")
    torch.testing.assert_close(client.get("x_sum", rank=2), sum(parts))
    # The launcher logs the restart from the thread that reaped the victim (it may come
    # after the newcomer joined), and the cluster logs on: read its whole log.
    wait_until(
        lambda: "restarted worker slot" in local.log_path.read_text(errors="replace"),
        30,
        "the launcher to log the restart",
    )
