"""A process group that breaks without a membership change is rebuilt, even when its
ranks saw it break seconds apart.

A follower stopped longer than the op timeout, but not long enough to lose its lease,
breaks the group: the leader and the other follower fail the op at the op timeout,
the stopped one only when it resumes. No new generation comes (every lease holds),
so each rank rebuilds the same generation's group once ``rebuild_after_s`` passed
since its own failure. The ranks must meet in one epoch, however far apart they
failed: each used to count epochs alone and give up an epoch after one op timeout,
and ranks that failed further apart than that never met again (seen on a loaded
machine: a shared cluster of the test suite stayed wedged for the rest of the run).
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch
from harness import wait_until

import collectives

pytestmark = pytest.mark.timeout(180)

LEASE_S = 8.0  # the stopped worker keeps its lease: no new generation
OP_TIMEOUT_S = 1.5
# How long the follower stays stopped: past the op timeout, by more than one op
# timeout after the others failed (so an epoch they open alone would have expired),
# within its lease.
STOPPED_S = 5.0


def _all_reduce_equals_torch(client, gen: torch.Generator) -> bool:
    parts = [torch.randn(33, generator=gen) for _ in range(client.world_size)]
    for rank, t in enumerate(parts):
        client.put("rebuild/x", t, rank=rank, timeout=5)
    client.all_reduce("rebuild/x", out="rebuild/sum", timeout=5)
    for rank in range(client.world_size):
        torch.testing.assert_close(client.get("rebuild/sum", rank=rank, timeout=5), sum(parts))
    return True


def _group_all_reduce_equals_torch(client, group, gen: torch.Generator) -> bool:
    parts = [torch.randn(17, generator=gen) for _ in range(client.world_size)]
    for rank, t in enumerate(parts):
        client.put("rebuild/g", t, rank=rank, timeout=5)
    client.all_reduce("rebuild/g", out="rebuild/gsum", group=group, timeout=5)
    want = sum(parts[r] for r in group.ranks)
    for rank in group.ranks:
        torch.testing.assert_close(client.get("rebuild/gsum", rank=rank, timeout=5), want)
    return True


def test_ranks_that_failed_seconds_apart_rebuild_one_group(fault_cluster, gen) -> None:
    """...and the groups a client made before the break work after it, under their ids
    (a group lasts as long as its generation: the rebuild is the same generation)."""
    cluster = fault_cluster(3, 3, lease_s=LEASE_S, op_timeout_s=OP_TIMEOUT_S)
    client = cluster.client
    assert _all_reduce_equals_torch(client, gen)
    group = client.new_group([0, 2])
    assert _group_all_reduce_equals_torch(client, group, gen)
    generation = client.generation
    stopped = cluster.daemon_at(cluster.members()[2].address)
    stopped.signal(signal.SIGSTOP)
    try:
        with pytest.raises(collectives.CollectiveError):
            client.all_reduce("rebuild/x", out="rebuild/sum", timeout=OP_TIMEOUT_S * 4)
        threading.Event().wait(STOPPED_S)  # the fault's length, not a synchronisation
    finally:
        stopped.signal(signal.SIGCONT)
    wait_until(
        lambda: _all_reduce_equals_torch(client, gen),
        LEASE_S * 5,
        "an all_reduce equal to torch's after the group was rebuilt",
    )
    assert client.generation == generation, "a new generation was sealed: nothing was rebuilt"
    # The stopped worker says, once it runs again, that it was held up (and for how long).
    wait_until(
        lambda: "this worker was held up for" in stopped.log_path.read_text(errors="replace"),
        10,
        "the stopped worker's note that it was held up",
    )
    assert _group_all_reduce_equals_torch(client, group, gen)
    later = client.new_group([1, 2])
    assert later.id > group.id
    assert _group_all_reduce_equals_torch(client, later, gen)
    for w in client.workers():
        log = cluster.daemon_at(w.address).log_path.read_text()
        assert "rebuilding the process group (epoch" in log, w.address
