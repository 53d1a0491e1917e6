"""A worker killed with SIGKILL: the op in flight fails instead of hanging, the
survivors re-form as a new generation within the lease, serve the next op, and
keep their named tensors.

The victim is stopped (SIGSTOP) before the op is submitted and killed while the
op waits on it, so the op is certainly in flight when the worker dies: no race
with a fast op finishing first.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import grpc
import pytest
import torch
from helpers import (
    LEASE_S,
    OP_TIMEOUT_S,
    assert_tensor,
    get_each,
    make_input,
    put_each,
    reduce_oracle,
    wait_until,
)
from launcher import stop_process

import collectives

log = logging.getLogger(__name__)

# Detection is heartbeat lease plus re-forming the process group; "a few seconds".
REFORM_S = LEASE_S + 5.0


def _members(cluster) -> list:
    """Members of the current generation in rank order."""
    workers = [w for w in cluster.workers() if w.rank >= 0]
    return sorted(workers, key=lambda w: w.rank)


def _ready_members(cluster, size: int) -> list | None:
    members = _members(cluster)
    if (
        cluster.world_size == size
        and len(members) == size
        and all(w.state == "ready" for w in members)
    ):
        return members
    return None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_follower_survivors_reform(fresh_cluster, gen):
    victim = 1  # the middle rank: the last survivor moves from rank 2 to rank 1
    local, cluster = fresh_cluster(3, "--min-workers", "2")
    members = wait_until(lambda: _ready_members(cluster, 3), 30, "3 ready workers")
    generation = cluster.generation
    assert [w.rank for w in members] == [0, 1, 2]
    pid = members[victim].pid
    # Only ever signal a process this test started.
    assert local.owns(pid), f"pid {pid} is not one of this cluster's processes"

    kept = {rank: make_input(torch.float32, (64, 3), gen) for rank in range(3)}
    put_each(cluster, "kept/per-rank", [kept[r] for r in range(3)])
    everywhere = make_input(torch.int64, (10,), gen)
    cluster.put("kept/everywhere", everywhere)
    put_each(cluster, "inflight", [make_input(torch.float32, (1 << 20,), gen) for _ in range(3)])

    stop_process(pid)
    try:
        handle = cluster.all_reduce("inflight", op="sum", async_op=True, timeout=60)
        assert not handle.done(), "the op finished although a member is stopped"
    finally:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()

    # 1. The op in flight ends with UNAVAILABLE (or DEADLINE_EXCEEDED), not a hang.
    exc = handle.exception(timeout=REFORM_S + OP_TIMEOUT_S)
    failed_after = time.monotonic() - killed_at
    assert isinstance(exc, collectives.CollectiveError), f"expected a CollectiveError: {exc!r}"
    assert exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
    if exc.code == grpc.StatusCode.UNAVAILABLE:
        # It names the generation the op ran in and says nothing was committed.
        assert f"generation {generation}" in exc.message, exc.message
        assert "nothing was committed" in exc.message, exc.message
    else:
        assert "may still complete" in exc.message, exc.message
    assert failed_after < REFORM_S + OP_TIMEOUT_S, f"op failed only after {failed_after:.1f} s"

    # 2. Within lease + a few seconds: a new generation of the two survivors.
    wait_until(
        lambda: cluster.generation > generation and cluster.world_size == 2,
        REFORM_S,
        "a new generation of 2 survivors",
    )
    survivors = wait_until(lambda: _ready_members(cluster, 2), REFORM_S, "2 ready survivors")
    reformed_after = time.monotonic() - killed_at
    expected_pids = [w.pid for w in members if w.rank != victim]
    assert [w.pid for w in survivors] == expected_pids, "survivors must keep their order"
    assert pid not in [w.pid for w in survivors]
    # Survivors keep their relative order; the lowest surviving rank leads.
    old_rank = [r for r in range(3) if r != victim]

    # 3. The next op on the survivors succeeds and is correct.
    inputs = [make_input(torch.float64, (5, 2), gen) for _ in range(2)]
    put_each(cluster, "after", inputs)
    cluster.all_reduce("after", op="sum", timeout=30)
    for rank, got in enumerate(get_each(cluster, "after")):
        assert_tensor(got, reduce_oracle("sum", inputs), exact=False, what=f"survivor {rank}")
    assert cluster.barrier(timeout=30) is None

    # 4. Their named tensors are intact.
    for new_rank, was in enumerate(old_rank):
        got = cluster.get("kept/per-rank", rank=new_rank)
        assert_tensor(got, kept[was], what=f"new rank {new_rank} (old rank {was})")
        assert_tensor(cluster.get("kept/everywhere", rank=new_rank), everywhere)
    log.info(
        f"op failed after {failed_after:.3f} s ({exc}); "
        f"survivors re-formed after {reformed_after:.2f} s"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_below_min_workers_ops_fail_unavailable_without_hanging(fresh_cluster):
    """With --min-workers 2, losing one of two workers leaves no quorum: ops fail
    with UNAVAILABLE within the op timeout instead of hanging."""
    local, cluster = fresh_cluster(2, "--min-workers", "2")
    members = wait_until(lambda: _ready_members(cluster, 2), 30, "2 ready workers")
    pid = members[1].pid
    assert local.owns(pid), f"pid {pid} is not one of this cluster's processes"
    os.kill(pid, signal.SIGKILL)

    # A barrier may slip through before the loss is seen; once it is, every op
    # fails (no quorum of 2) within the op timeout rather than hanging.
    deadline = time.monotonic() + REFORM_S + OP_TIMEOUT_S
    while True:
        start = time.monotonic()
        try:
            cluster.barrier(timeout=OP_TIMEOUT_S + 5)
        except collectives.CollectiveError as exc:
            err = exc
            break
        assert time.monotonic() < deadline, "ops still succeed long after losing quorum"
    assert err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), err
    assert time.monotonic() - start < OP_TIMEOUT_S + 5
