"""An op runs in the generation it was issued for, or not at all.

Two scenarios a new user hit, each on real processes with real signals, each
repeated ``COLLECTIVES_BINDING_RUNS`` times (default 2). Both would return
*success* with the sum over the survivors only if the SDK retried a
never-started op on the smaller generation; both must fail with ``UNAVAILABLE``
(or ``DEADLINE_EXCEEDED`` when the op was blocked on the stopped peer) within
op timeout + lease + 2 s, the error names the generation the op was issued for,
and nothing is stored under the output name.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from harness import LEASE_S, OP_TIMEOUT_S, FaultCluster
from helpers import wait_until

import collectives

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUNS = int(os.environ.get("COLLECTIVES_BINDING_RUNS", "2"))
BOUND_S = OP_TIMEOUT_S + LEASE_S + 2.0
CALL_TIMEOUT_S = 30.0  # the SDK's default: long enough for a retry on a new generation


def _place_operands(cluster: FaultCluster, gen: torch.Generator) -> list[torch.Tensor]:
    members = cluster.members()
    parts = [torch.randn(1024, generator=gen) for _ in members]
    for w, t in zip(members, parts, strict=True):
        cluster.client.put("x", t, rank=w.rank)
    return parts


def _assert_not_committed(
    cluster: FaultCluster, generation: int, err, started: float, survivors: int
) -> None:
    took = time.monotonic() - started
    assert err.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), err
    assert took < BOUND_S, f"failed after {took:.1f} s, bound {BOUND_S:.1f} s: {err}"
    assert err.generation == generation, (err.generation, generation, err)
    assert f"generation {generation}" in err.message, err.message
    # The op did not run anywhere: no survivor holds a result.
    cluster.wait_ready(survivors, after_generation=generation, timeout_s=30)
    for w in cluster.members():
        with pytest.raises(collectives.NotFound):
            cluster.client.get("x_sum", rank=w.rank)


@pytest.mark.parametrize("run", range(RUNS))
def test_an_op_issued_while_a_follower_is_stopped_fails_instead_of_reducing_survivors(
    fault_cluster, gen, run
) -> None:
    cluster = fault_cluster(3, 2)
    _place_operands(cluster, gen)
    generation = cluster.client.generation
    stopped = cluster.daemon_at(cluster.members()[2].address)
    stopped.signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(collectives.CollectiveError) as info:
            cluster.client.all_reduce("x", out="x_sum", timeout=CALL_TIMEOUT_S)
        _assert_not_committed(cluster, generation, info.value, started, survivors=2)
    finally:
        stopped.signal(signal.SIGCONT)


@pytest.mark.parametrize("run", range(RUNS))
def test_an_op_issued_right_after_a_worker_died_fails_instead_of_reducing_survivors(
    fault_cluster, gen, run
) -> None:
    """The op is sent for the generation the worker died in: the coordinator is held
    (SIGSTOP) from just before the kill until the op is sent, so this client cannot
    have heard of the survivors' generation yet (the crash is seen in milliseconds).
    The coordinator then seals that generation while the op fails, which is when a
    retry onto it would happen."""
    cluster = fault_cluster(2, 1)
    _place_operands(cluster, gen)
    generation = cluster.client.generation
    victim = cluster.daemon_at(cluster.members()[1].address)
    cluster.coordinator.signal(signal.SIGSTOP)
    try:
        victim.signal(signal.SIGKILL)
        started = time.monotonic()
        work = cluster.client.all_reduce("x", out="x_sum", timeout=CALL_TIMEOUT_S, async_op=True)
        wait_until(lambda: work.generation is not None, 10, "the op to be sent")
    finally:
        cluster.coordinator.signal(signal.SIGCONT)
    with pytest.raises(collectives.CollectiveError) as info:
        work.wait()
    assert work.generation == generation
    _assert_not_committed(cluster, generation, info.value, started, survivors=1)


def test_a_successful_op_reports_the_generation_it_ran_in(fault_cluster, gen) -> None:
    cluster = fault_cluster(2, 2)
    parts = _place_operands(cluster, gen)
    work = cluster.client.all_reduce("x", out="x_sum", async_op=True)
    assert work.wait() is None
    assert work.generation == cluster.client.generation
    torch.testing.assert_close(cluster.client.get("x_sum", rank=1), sum(parts))
