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
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

import collectives
from collectives.ops import data_plane as _data_plane
from collectives.transport import shm
from collectives.wire.shm import SHM_DIR

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")

TIMEOUT_S = 30.0
MiB = 1 << 20
NOBODY = 65534


def _our_segments() -> set[str]:
    """This process's segments (other processes on the host may be making theirs)."""
    return set(glob.glob(os.path.join(SHM_DIR, f"collectives-seg-{os.getpid()}-*")))


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
        held = [s for worker in client._session.shm_pool._lent.values() for s in worker.values()]
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
        free = [segment for _, segment in client._session.shm_pool._free]
        assert free and all(s.named and s.path in _our_segments() for s in free)
        client.put("adopt/b", second, rank=0)
        assert torch.equal(client.get("adopt/b", rank=0), second)
        client.delete("adopt/a", rank=0)
        client.delete("adopt/b", rank=0)


# Run as uid nobody: writes a segment, hands it over, then truncates it while the
# worker would be reading it if it had mapped it; prints adopted and the bytes' hash.
_OTHER_USER_CLIENT = """
import hashlib, os, sys
import grpc, torch
from collectives.transport import shm
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire import codec
address, name = sys.argv[1], sys.argv[2]
t = torch.frombuffer(bytearray(os.urandom(4 << 20)), dtype=torch.uint8)
segment = shm.Segment.create(t.numel())
segment.write(t)
request = worker_pb2.PutTensorShmRequest(
    header=codec.make_header(name, t), path=segment.path, hand_over=True
)
with grpc.insecure_channel(address) as channel:
    reply = worker_pb2_grpc.WorkerStub(channel).PutTensorShm(request, timeout=30)
os.ftruncate(segment.fd, 0)
segment.destroy()
print(reply.adopted, hashlib.sha256(t.numpy().tobytes()).hexdigest())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another user needs root")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_another_users_segment_is_copied_so_truncating_it_cannot_crash_the_worker(
    cluster2_address, cluster2
):
    """A root worker serving uid nobody never maps that user's files: the truncation
    that would be a SIGBUS in a mapping leaves the worker serving the bytes it copied."""
    client_dir = os.path.dirname(os.path.dirname(os.path.abspath(shm.__file__)))
    worker = max(cluster2.workers(), key=lambda w: w.rank)
    name = f"adopt/nobody-{os.getpid()}"
    child = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-c", _OTHER_USER_CLIENT, worker.address, name],
        env={"PYTHONPATH": client_dir, "PATH": os.environ.get("PATH", "")},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if child.returncode != 0 and "ModuleNotFoundError" in child.stderr + child.stdout:
        pytest.skip(f"user nobody cannot import the SDK here: {child.stderr[-300:]}")
    assert child.returncode == 0, child.stderr
    adopted, digest = child.stdout.split()
    assert adopted == "False", "the worker mapped another user's segment"
    back = cluster2.get(name, rank=worker.rank)
    assert hashlib.sha256(back.numpy().tobytes()).hexdigest() == digest
    cluster2.delete(name, rank=worker.rank)
