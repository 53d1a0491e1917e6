"""Two clients on one named tensor: a put or a delete never lost under another
client's collective that writes it.

A collective reads its operand on each rank and later stores its result, under the
same name (in place) or under ``out``. A put (or delete) of that name on a rank in
between, answered before the collective committed there, is later in the order
than the collective's start: the collective's result must not be stored over it
(it used to be, and the put was lost, or the deleted tensor came back).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import collectives
from collectives.errors import Reason

pytestmark = pytest.mark.timeout(180)

# Each race runs this long at most, and this many rounds at most.
RACE_S = 6.0
ROUNDS = 400


class _Reducing:
    """Another client all-reducing ``name`` (max) without pause until stopped, in place
    or into ``out``."""

    def __init__(self, address: str, name: str, out: str | None = None) -> None:
        self._address, self._name, self._out = address, name, out
        self._stop = threading.Event()
        self.ops = self.attempts = 0
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with collectives.connect(self._address, timeout=60) as client:
            while not self._stop.is_set():
                self.attempts += 1
                try:
                    client.all_reduce(self._name, op="max", out=self._out, timeout=60)
                    self.ops += 1
                except collectives.NotFound:
                    pass  # deleted on every rank: the race test puts it again
                except collectives.FailedPrecondition as exc:
                    if exc.reason != Reason.OPERAND_MISSING:
                        self.errors.append(exc)
                        return
                except BaseException as exc:  # the test's finding
                    self.errors.append(exc)
                    return

    def __enter__(self) -> _Reducing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the reducing client did not stop"
        assert self.errors == [], self.errors


@pytest.mark.parametrize("rank", [0, 1], ids=["leader", "follower"])
@pytest.mark.parametrize("numel", [16, 300_000], ids=["inline", "data-path"])
def test_a_put_is_never_lost_under_an_in_place_all_reduce(
    cluster3, cluster3_address, uname, rank: int, numel: int
) -> None:
    """Puts of increasing values on one rank, each read back at once: with max as the
    reduction, every order of the puts and the all_reduces leaves at least the value
    put there."""
    name = uname("lost")
    cluster3.put(name, torch.zeros(numel))
    with _Reducing(cluster3_address, name) as reducing:
        deadline, value = time.monotonic() + RACE_S, 0.0
        for _ in range(ROUNDS):
            if time.monotonic() > deadline:
                break
            value += 1.0
            cluster3.put(name, torch.full((numel,), value), rank=rank)
            got = cluster3.get(name, rank=rank)
            assert got.min() >= value, (
                f"put {value} on rank {rank} answered, then the rank held {got.min()}: "
                f"an all_reduce that read before the put was stored over it "
                f"({reducing.ops} all_reduces so far)"
            )
    assert reducing.ops > 0
    cluster3.delete(name)


@pytest.mark.parametrize("rank", [0, 1], ids=["leader", "follower"])
def test_a_delete_is_never_undone_by_an_in_place_all_reduce(
    cluster3, cluster3_address, uname, rank: int
) -> None:
    """After ``delete`` on a rank answered, the name is gone there until put again,
    whatever all_reduce of it ran meanwhile."""
    name = uname("gone")
    with _Reducing(cluster3_address, name) as reducing:
        deadline = time.monotonic() + RACE_S
        for round_ in range(ROUNDS):
            if time.monotonic() > deadline:
                break
            cluster3.put(name, torch.randn(4))
            cluster3.delete(name, rank=rank)
            with pytest.raises(collectives.NotFound):
                cluster3.get(name, rank=rank)
                pytest.fail(f"round {round_}: deleted on rank {rank}, then found there again")
    assert reducing.attempts > 0
    cluster3.delete(name, missing_ok=True)


@pytest.mark.parametrize("rank", [0, 1], ids=["leader", "follower"])
@pytest.mark.parametrize("numel", [16, 300_000], ids=["inline", "data-path"])
def test_a_put_is_never_lost_under_a_collective_that_writes_it_out_of_place(
    cluster3, cluster3_address, uname, rank: int, numel: int
) -> None:
    """One client puts ``a`` then ``b`` on a rank, each answered, then reads ``b``;
    another all-reduces ``a`` into ``b`` (max) meanwhile. Each order of the three
    leaves ``b`` either as put or the max over the new ``a``; an all_reduce that read
    the old ``a`` and stored its result over the later put of ``b`` fits no order
    (it happened on the leader)."""
    source, target = uname("src"), uname("dst")
    cluster3.put(source, torch.zeros(numel))
    cluster3.put(target, torch.zeros(numel))
    with _Reducing(cluster3_address, source, target) as reducing:
        deadline = time.monotonic() + RACE_S
        for k in range(1, ROUNDS):
            if time.monotonic() > deadline:
                break
            cluster3.put(source, torch.full((numel,), float(k)), rank=rank)
            cluster3.put(target, torch.full((numel,), -float(k)), rank=rank)
            got = cluster3.get(target, rank=rank)
            assert got.min() == got.max() and float(got[0]) in (-k, k), (
                f"round {k}: rank {rank} holds {float(got[0])} under the target: an "
                f"all_reduce of the source before its put {k} was stored over the later "
                f"put of the target ({reducing.ops} all_reduces so far)"
            )
    assert reducing.ops > 0
    cluster3.delete(source)
    cluster3.delete(target)


@pytest.mark.parametrize("rank", [0, 1], ids=["leader", "follower"])
def test_a_delete_is_never_undone_by_a_collective_that_writes_it_out_of_place(
    cluster3, cluster3_address, uname, rank: int
) -> None:
    """After ``delete`` of the target on a rank answered, the name is gone there until
    written again by an all_reduce that began after the delete (its result then holds
    the newest source), never by one that read the source before."""
    source, target = uname("src"), uname("dst")
    cluster3.put(source, torch.zeros(300_000))
    with _Reducing(cluster3_address, source, target) as reducing:
        deadline = time.monotonic() + RACE_S
        for k in range(1, ROUNDS):
            if time.monotonic() > deadline:
                break
            cluster3.put(source, torch.full((300_000,), float(k)), rank=rank)
            cluster3.delete(target, rank=rank, missing_ok=True)
            try:
                got = float(cluster3.get(target, rank=rank)[0])
            except collectives.NotFound:
                continue
            assert got == k, (
                f"round {k}: deleted on rank {rank}, then found holding {got}: an "
                "all_reduce of the source before its put stored its result there again"
            )
    assert reducing.ops > 0
    cluster3.delete(source)
    cluster3.delete(target, missing_ok=True)


class _Overwriting:
    """Another client putting -1s under ``names`` on ``rank`` without pause until stopped."""

    def __init__(self, address: str, names: list[str], rank: int, shapes: list[tuple]) -> None:
        self._args = address, names, rank, shapes
        self._stop = threading.Event()
        self.puts = 0
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        address, names, rank, shapes = self._args
        with collectives.connect(address, timeout=60) as client:
            while not self._stop.is_set():
                for name, shape in zip(names, shapes, strict=True):
                    try:
                        client.put(name, -torch.ones(shape), rank=rank, timeout=60)
                        self.puts += 1
                    except BaseException as exc:  # the test's finding
                        self.errors.append(exc)
                        return

    def __enter__(self) -> _Overwriting:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the overwriting client did not stop"
        assert self.errors == [], self.errors


def test_reduce_and_gather_return_their_result_or_say_it_was_written_over(
    cluster3, cluster3_address, gen, uname
) -> None:
    """reduce and gather return the result they read back from ``dst`` right after the
    op. Another client writing the result's name there in between used to be what
    they returned; now it is refused (RESULT_REPLACED), and every value returned is
    torch's reduction or gather of the operands."""
    name, reduced, gathered = uname("x"), uname("y"), uname("z")
    operands = [torch.randn(4, generator=gen) for _ in range(cluster3.world_size)]
    for rank, t in enumerate(operands):
        cluster3.put(name, t, rank=rank)
    want_sum, want_parts = torch.stack(operands).sum(0), operands
    returned = refused = 0
    with _Overwriting(cluster3_address, [reduced, gathered], 1, [(4,), (3, 4)]):
        deadline = time.monotonic() + RACE_S
        for _ in range(ROUNDS):
            if time.monotonic() > deadline:
                break
            try:
                got = cluster3.reduce(name, dst=1, out=reduced)
                torch.testing.assert_close(got, want_sum, rtol=1e-5, atol=1e-6)
                parts = cluster3.gather(name, dst=1, out=gathered)
                for part, want in zip(parts, want_parts, strict=True):
                    torch.testing.assert_close(part, want, rtol=0, atol=0)
                returned += 1
            except collectives.FailedPrecondition as exc:
                assert exc.reason == Reason.RESULT_REPLACED, exc
                refused += 1
    assert returned > 0, f"every read-back was refused ({refused})"
