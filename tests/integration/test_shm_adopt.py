"""A same-user put hands its segment over: the worker keeps the tensor in it (no copy).

The SDK and the worker run as one user here, so a put of 1 MiB or more to one
rank is adopted (spied on the response). What must hold: every get returns
exactly the bytes put (fresh random data each round), later puts and gets
never write into a segment that holds a stored tensor, a segment comes back to
the client's pool once the worker drops its tensor, and a stored tensor
outlives the client that put it (the worker's mapping outlives the name).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

import collectives
from collectives import _data_plane, shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")

TIMEOUT_S = 30.0
MiB = 1 << 20


def _our_segments() -> set[str]:
    """This process's segments (other processes on the host may be making theirs)."""
    return set(glob.glob(os.path.join(shm.SHM_DIR, f"collectives-seg-{os.getpid()}-*")))


class _Answers:
    """The PutTensorShm responses the SDK received (the real calls still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.adopted: list[bool] = []
        real = _data_plane.put_tensor_shm

        def spy(*args, **kwargs):
            response = real(*args, **kwargs)
            self.adopted.append(response.adopted)
            return response

        monkeypatch.setattr(_data_plane, "put_tensor_shm", spy)


def test_puts_are_adopted_and_gets_return_the_exact_bytes(cluster2_address, gen, monkeypatch):
    answers = _Answers(monkeypatch)
    before = _our_segments()
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as client:
        for _ in range(5):
            t = torch.randn(MiB, generator=gen)  # 4 MiB, new bytes each round
            client.put("adopt/x", t, rank=1)
            assert torch.equal(client.get("adopt/x", rank=1), t)
        assert answers.adopted == [True] * 5
        # Two segments take turns: each put's answer returns the one its tensor replaced.
        assert len(_our_segments() - before) <= shm.MAX_HANDED_OVER + 1
        client.delete("adopt/x", rank=1)
    assert _our_segments() <= before, "a segment handed over was left behind"


def test_a_stored_tensor_never_changes_through_the_clients_segments(cluster2_address, gen):
    """Tensors held in segments stay intact while the client keeps putting and getting
    other tensors of the same size (its pool must never lease a held segment)."""
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as client:
        kept = {f"adopt/keep{i}": torch.randn(MiB, generator=gen) for i in range(3)}
        for name, t in kept.items():
            client.put(name, t, rank=0)
        for _ in range(4):
            client.put("adopt/churn", torch.randn(MiB, generator=gen), rank=0)
            client.get("adopt/churn", rank=0).fill_(7)  # a get's result is the client's to write
        for name, t in kept.items():
            assert torch.equal(client.get(name, rank=0), t), name
        held = [s for worker in client._shm_pool._lent.values() for s in worker.values()]
        assert held and all(s.holder is not None for s in held)
        for name in [*kept, "adopt/churn"]:
            client.delete(name, rank=0)


def test_a_stored_tensor_outlives_the_client_that_put_it(cluster2_address, gen):
    t = torch.randn(2 * MiB, generator=gen)
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as client:
        client.put("adopt/orphan", t, rank=0)
    # The client unlinked its segments on close; the worker's mapping keeps the bytes.
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as other:
        assert torch.equal(other.get("adopt/orphan", rank=0), t)
        other.put("adopt/orphan", torch.zeros(3), rank=0)  # drops it: the mapping goes
        other.delete("adopt/orphan", rank=0)


def test_a_put_to_every_rank_is_copied(cluster2_address, gen, monkeypatch):
    """One segment read by several workers must stay the client's: no hand-over."""
    answers = _Answers(monkeypatch)
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as client:
        t = torch.randn(MiB, generator=gen)
        client.put("adopt/all", t)
        for rank in range(client.world_size):
            assert torch.equal(client.get("adopt/all", rank=rank), t)
        assert answers.adopted == [False] * client.world_size
        client.delete("adopt/all")


def test_a_segment_the_worker_made_for_a_get_is_renamed_before_the_pool_reuses_it(
    cluster2_address, gen
):
    """With every pooled segment handed over, a get gets a segment the worker made; the
    worker unlinks that name after its TTL, so the client renames it to one of its own
    before a later put hands the path to a worker."""
    with collectives.connect(cluster2_address, timeout=TIMEOUT_S, shared_memory=True) as client:
        first, second = torch.randn(MiB, generator=gen), torch.randn(MiB, generator=gen)
        client.put("adopt/a", first, rank=0)  # the only segment is handed over
        assert torch.equal(client.get("adopt/a", rank=0), first)
        free = [segment for _, segment in client._shm_pool._free]
        assert free and all(s.named and s.path in _our_segments() for s in free)
        client.put("adopt/b", second, rank=0)
        assert torch.equal(client.get("adopt/b", rank=0), second)
        client.delete("adopt/a", rank=0)
        client.delete("adopt/b", rank=0)
