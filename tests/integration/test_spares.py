"""Spares: live workers beyond the generation's size (``local --spares K``), listed as
such, each taking a member's place as soon as one is lost, and the dead member's slot
started again as the next spare."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import assert_tensor, get_each, put_each, reduce_oracle, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

FLAGS = ("--heartbeat", "0.2", "--lease", "1.5", "--devices", "cpu", "--max-restarts", "1")


def _members(cluster) -> list:
    return [w for w in cluster.workers() if w.rank >= 0]


def _spares(cluster) -> list:
    return [w for w in cluster.workers() if w.state == "spare"]


def _all_reduce_matches_torch(cluster, gen: torch.Generator, name: str) -> None:
    world = cluster.world_size
    inputs = [torch.randn(257, generator=gen) for _ in range(world)]
    put_each(cluster, name, inputs)
    cluster.all_reduce(name, timeout=60)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, reduce_oracle("sum", inputs), what=f"{name} on rank {rank}")


def test_a_spare_is_listed_and_takes_a_lost_members_place(fresh_cluster, gen) -> None:
    local, cluster = fresh_cluster(2, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    (spare,) = _spares(cluster)
    assert spare.rank == -1 and local.owns(spare.pid)
    assert cluster.world_size == 2 and len(cluster.workers()) == 3
    _all_reduce_matches_torch(cluster, gen, "before")

    generation = cluster.generation
    victim = _members(cluster)[1]
    os.kill(victim.pid, signal.SIGKILL)

    def spare_is_member() -> bool:
        members = {w.worker_id for w in _members(cluster)}
        return cluster.generation > generation and cluster.formed and spare.worker_id in members

    wait_until(spare_is_member, 30, "the spare to take the lost member's place")
    assert cluster.world_size == 2
    _all_reduce_matches_torch(cluster, gen, "after")

    # The dead member's slot is started again (--max-restarts) and waits as the next spare.
    wait_until(
        lambda: [w.pid for w in _spares(cluster)] not in ([], [victim.pid]),
        60,
        "the restarted worker to wait as a spare",
    )
    (again,) = _spares(cluster)
    assert again.pid != victim.pid and local.owns(again.pid)
