"""A shared-memory call the client gave up on must never touch a later call's bytes.

A get leases one of the client's segments to the worker, which writes the
tensor into it; a put hands the worker a segment to read. When the client's
deadline runs out first, the worker may still be copying (a busy or slow
worker runs a call it accepted to the end). Were that segment back in the
client's pool, the next put would write its bytes there and the late copy would
replace them: a tensor stored and reduced that the caller never sent, reported
as success. Here the worker is stopped with SIGSTOP so the deadline certainly
runs out; the segment of each failed call must be unlinked and out of the pool,
and after SIGCONT every tensor still reads back exactly.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import collectives
from collectives.transport import shm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm"),
]

MiB = 1 << 20
# The stopped worker must stay a member while the test runs its steps under
# SIGSTOP, however loaded the machine: what is tested is the client's deadline,
# not eviction, so the lease is far longer than any step.
LONG_LEASE_S = 60.0


def _pooled(client: collectives.Cluster) -> dict[tuple[int, int], str]:
    """(device, inode) -> path of every free segment in the client's pool."""
    found = {}
    for _, segment in client._session.shm_pool._free:
        stat = os.fstat(segment.fd)
        found[stat.st_dev, stat.st_ino] = segment.path
    return found


@pytest.mark.parametrize("call", ["get", "put", "handed-over put"])
def test_a_segment_of_a_call_given_up_on_is_never_reused(fault_cluster, gen, call) -> None:
    cluster = fault_cluster(2, 2, lease_s=LONG_LEASE_S)
    src, dst = cluster.members()[1], cluster.members()[0]
    with collectives.connect(cluster.coordinator.address, timeout=60, shared_memory=True) as client:
        big = torch.randn(MiB, generator=gen)
        client.put("late/src", big, rank=src.rank)
        # The get's segment returns to the client's pool once the tensor is freed.
        assert torch.equal(client.get("late/src", rank=src.rank), big)
        before = _pooled(client)
        assert before, "no segment was pooled: nothing would be leased"
        stopped = cluster.daemon_at(src.address)
        stopped.signal(signal.SIGSTOP)
        try:
            with pytest.raises(collectives.DeadlineExceeded):
                if call == "get":
                    client.get("late/src", rank=src.rank, timeout=0.3)
                elif call == "put":  # small: copied, not handed over
                    small = torch.randn(1000, generator=gen)
                    client.put("late/small", small, rank=src.rank, timeout=0.3)
                else:  # offered to the worker to keep: the client never writes it until returned
                    kept = torch.randn(MiB, generator=gen)
                    client.put("late/kept", kept, rank=src.rank, timeout=0.3)
            after = _pooled(client)
            given_up = set(before) - set(after)
            assert given_up, f"the {call}'s segment went back to the pool"
            if call != "handed-over put":  # that one keeps its name until returned
                for key in given_up:
                    assert not os.path.exists(before[key]), "a segment given up on kept its name"
            t = torch.randn(MiB // 4, generator=gen)
            client.put("late/dst", t, rank=dst.rank)
        finally:
            stopped.signal(signal.SIGCONT)
        assert torch.equal(client.get("late/dst", rank=dst.rank), t)
        assert torch.equal(client.get("late/src", rank=src.rank), big)
        # A later put to that worker is answered with the segments it does not
        # hold: the one of the failed put comes back, and is destroyed, not pooled.
        again = torch.randn(MiB, generator=gen)
        client.put("late/src", again, rank=src.rank)
        assert torch.equal(client.get("late/src", rank=src.rank), again)
        for key in given_up:
            assert key not in _pooled(client) and not os.path.exists(before[key])
