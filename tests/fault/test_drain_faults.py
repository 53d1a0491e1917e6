"""A drain racing a crash: of the spare taking the rank, of the drained worker, and of
the leader. Each ends in a clean state: the drain completes or fails saying why,
no tensor is half moved (a rank holds all of what it held, or, after a crash, none
of it), and no op returns a wrong result meanwhile or after.

The drained rank holds 512 MiB, so its handoff takes a while; the crash lands as
soon as the coordinator's watch shows the drain in progress. Which side of the race
a run lands on is up to the machine: the checks hold on both. Each race runs twice:
while the drain prepares its generation (the default: the groups formed and the
tensors copied ahead, the current generation serving), and with the preparation
off (``--drain-prepare-s 0``: sealed at once, everything after the seal).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import torch
from harness import record
from helpers import assert_tensor, wait_until

import collectives
from collectives.session import drains
from collectives.v1 import coordinator_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FLAGS = (
    "--spares", "1", "--min-workers", "2", "--heartbeat", "0.2", "--lease", "3",
    "--devices", "cpu", "--max-restarts", "2",
)  # fmt: skip
DRAINED = 1
BIG = [f"race/big/{i}" for i in range(16)]  # 16 x 32 MiB on the drained rank


class Calls:
    """A client all-reducing a tensor resident on every rank until stopped. A call may
    fail (a rank crashed, a newcomer lacks the operand); one that succeeds must equal
    the sum of what the members of its generation hold: each original worker its own
    tensor, the successor of a completed drain the drained worker's. A call is judged
    when the membership did not change while it ran (else the contributors are not
    known: a refusal or a result over the new members are both correct)."""

    def __init__(self, address: str, held: dict[str, torch.Tensor]) -> None:
        self._address = address
        self._held = held  # worker id -> its resident tensor, at the start
        self._stop = threading.Event()
        self.wrong: list[str] = []
        self.ok = self.failed = self.unjudged = self.judged = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Calls:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive()

    def _expected(self, view) -> torch.Tensor | None:
        """The sum over ``view``'s members; None when a member holds no operand."""
        parts = []
        for member in view.members:
            value = self._held.get(member.worker_id)
            if value is None:
                took = [
                    d for d in view.drains if not d.error and d.successor_id == member.worker_id
                ]
                value = self._held.get(took[-1].worker_id) if took else None
            if value is None:
                return None
            parts.append(value)
        return torch.stack(parts).sum(0)

    def _run(self) -> None:
        with collectives.connect(self._address, timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                out = f"race/sum/{n % 3}"
                before = client.refresh()
                try:
                    client.all_reduce("race/resident", out=out, timeout=20)
                    got = client.get(out, rank=n % client.world_size, timeout=20)
                except collectives.CollectiveError:
                    self.failed += 1
                    n += 1
                    continue
                after = client.refresh()
                self.ok += 1
                if before.generation != after.generation:
                    self.unjudged += 1
                    n += 1
                    continue
                self.judged += 1
                want = self._expected(after)
                if want is None:
                    self.wrong.append(f"call {n}: succeeded though a member holds no operand")
                elif got.shape != want.shape or not torch.allclose(got, want, atol=1e-5):
                    self.wrong.append(f"call {n}: all_reduce returned another sum")
                n += 1


def _prepared(fresh_cluster, gen, prepare: str):
    extra = ("--drain-prepare-s", prepare) if prepare else ()
    local, cluster = fresh_cluster(3, *FLAGS, *extra)
    wait_until(lambda: any(w.state == "spare" for w in cluster.workers()), 30, "the spare")
    resident = [torch.randn(1000, generator=gen) for _ in range(3)]
    for rank, t in enumerate(resident):
        cluster.put("race/resident", t, rank=rank)
    big = {name: torch.randn(8 * 1024 * 1024, generator=gen) for name in BIG}
    for name, t in big.items():
        cluster.put(name, t, rank=DRAINED)
    return local, cluster, resident, big


def _drain_racing(local, cluster, victim_of) -> tuple[object, float]:
    """Drains rank DRAINED in a thread, SIGKILLs ``victim_of(drain_in_progress)`` as soon
    as the watch shows the drain; returns (the report or the error, seconds to the end)."""
    outcome: dict[str, object] = {}
    target = cluster.workers()[DRAINED]

    def drain() -> None:
        try:
            outcome["report"] = cluster.drain(target.worker_id, timeout=60)
        except collectives.CollectiveError as err:
            outcome["error"] = err

    thread = threading.Thread(target=drain)
    with grpc.insecure_channel(local.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        thread.start()
        view = drains.wait_for(stub, lambda s: s.drain is not None, 30, "the drain to start")
    victim = victim_of(view)
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the drain did not end"
    return outcome.get("report", outcome.get("error")), time.monotonic() - killed


def _state_is_clean(cluster, originals: dict[str, int], resident, big, ended) -> None:
    """Every member holds what its worker held, all of it or (a worker new to the ranks)
    none of it: an original worker its own tensors, the successor of a completed drain
    the drained rank's, any other newcomer nothing of them."""
    wait_until(lambda: cluster.refresh().ready, 60, "the cluster to serve again")
    members = {w.worker_id: w.rank for w in cluster.workers() if w.rank >= 0}
    completed_onto = ended.successor_id if isinstance(ended, collectives.DrainReport) else ""
    for worker_id, rank in members.items():
        if worker_id in originals:
            own = originals[worker_id]
            assert_tensor(cluster.get("race/resident", rank=rank), resident[own])
            if own == DRAINED:
                _holds(cluster, rank, big)
        elif worker_id == completed_onto:
            assert_tensor(cluster.get("race/resident", rank=rank), resident[DRAINED])
            _holds(cluster, rank, big)
        else:
            for name in ("race/resident", BIG[0], BIG[-1]):
                with pytest.raises(collectives.NotFound):
                    cluster.get(name, rank=rank, timeout=30)


def _holds(cluster, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    for name, want in tensors.items():
        assert_tensor(cluster.get(name, rank=rank, timeout=30), want, what=f"{name} on {rank}")


def _by_id(view, worker_id: str):
    return next(w for w in view.workers if w.worker_id == worker_id)


def _race(fresh_cluster, gen, prepare: str, victim_of, fault: str) -> None:
    local, cluster, resident, big = _prepared(fresh_cluster, gen, prepare)
    originals = {w.worker_id: w.rank for w in cluster.workers() if w.rank >= 0}
    held = {w.worker_id: resident[w.rank] for w in cluster.workers() if w.rank >= 0}
    with Calls(local.address, held) as calls:
        ended, seconds = _drain_racing(local, cluster, victim_of)
        if isinstance(ended, collectives.CollectiveError):
            assert ended.code == grpc.StatusCode.ABORTED, ended  # said why, changed nothing
        else:
            assert ended.error == "" and ended.bytes_moved >= 16 * 32 * 2**20, ended
        victims = {w.worker_id for w in cluster.workers() if w.state == "lost"}
        done = calls.ok + calls.failed
        wait_until(lambda: calls.ok + calls.failed > done + 2, 60, "calls after the race")
        _state_is_clean(cluster, {k: v for k, v in originals.items() if k not in victims},
                        resident, big, ended)  # fmt: skip
    assert calls.wrong == [], calls.wrong
    fault += " (prepared)" if not prepare else " (sealed at once)"
    record(fault, seconds, seconds, "completed" if not isinstance(ended, Exception) else "failed")


# "": the default preparation; "0": none (sealed at once).
PREPARE = pytest.mark.parametrize("prepare", ["", "0"], ids=["prepared", "sealed-at-once"])


@PREPARE
def test_the_spare_crashing_mid_handoff(fresh_cluster, gen, prepare: str) -> None:
    _race(
        fresh_cluster,
        gen,
        prepare,
        lambda view: _by_id(view, view.drain.successor_id),
        "drain racing the spare's crash",
    )


@PREPARE
def test_the_drained_worker_crashing_mid_handoff(fresh_cluster, gen, prepare: str) -> None:
    _race(
        fresh_cluster,
        gen,
        prepare,
        lambda view: _by_id(view, view.drain.worker_id),
        "drain racing the drained worker's crash",
    )


@PREPARE
def test_the_leader_crashing_mid_handoff(fresh_cluster, gen, prepare: str) -> None:
    _race(
        fresh_cluster,
        gen,
        prepare,
        lambda view: next(w for w in view.workers if w.rank == 0),
        "drain racing the leader's crash",
    )
