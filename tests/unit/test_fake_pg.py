"""tests/fake_pg.py against its oracle, real gloo groups (one per rank thread, one shared
HashStore): the same random inputs give identical outputs. Float inputs are small multiples
of 1/16, so sums and products are exact and gloo's summation order (not rank order for 3
ranks) cannot change a bit. Then failure injection, deadlines and call counting."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fake_pg import FakeProcessGroup, FakeWorld, run_ranks
from gloo_world import GlooWorlds

from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives_server.worker.engine import agreement, descriptor
from collectives_server.worker.kernels import collective_ops

SIZES = (2, 3)
DTYPES = (torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool)
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")


@pytest.fixture(scope="module")
def gloo() -> GlooWorlds:
    """``gloo(size)``: a world of real gloo groups, built once per size for the module."""
    return GlooWorlds(timeout_s=10)


def _inputs(gen: torch.Generator, size: int, dtype: torch.dtype, shape: tuple[int, ...]):
    def one() -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=dtype).mul(16).round().div(16)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        if dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=gen, dtype=dtype)
        return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)

    return [one() for _ in range(size)]


def _same(fake: Any, real: Any, where: str) -> None:
    if isinstance(real, BaseException):
        assert type(fake) is type(real), f"{where}: fake {fake!r}, gloo raised {real!r}"
        assert str(fake) in str(real) or str(real) in str(fake), f"{where}: {fake} / {real}"
    elif isinstance(real, torch.Tensor):
        assert isinstance(fake, torch.Tensor), f"{where}: fake gave {fake!r}"
        assert fake.dtype == real.dtype and torch.equal(fake, real), f"{where}:\n{fake}\n{real}"
    elif isinstance(real, list | tuple):
        assert isinstance(fake, list | tuple) and len(fake) == len(real), f"{where}: {fake}"
        for i, (f, r) in enumerate(zip(fake, real, strict=True)):
            _same(f, r, f"{where}[{i}]")
    else:
        assert fake == real, f"{where}: {fake!r} != {real!r}"


def _against_gloo(gloo: Callable[[int], Any], size: int, fn: Callable[..., Any]) -> list[Any]:
    """Runs ``fn`` over a fake world and over gloo; asserts every rank's result is the same."""
    fake = run_ranks(FakeWorld(size), fn, timeout_s=20)
    real = run_ranks(gloo(size), fn, timeout_s=20)
    for rank in range(size):
        _same(fake[rank], real[rank], f"rank {rank}")
    return fake


# ---------------------------------------------------------------- oracle: gloo
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_allreduce_matches_gloo(gloo, gen, size: int, dtype: torch.dtype, op: str) -> None:
    xs = _inputs(gen, size, dtype, (5, 7))

    def fn(rank: int, pg: Any) -> torch.Tensor:
        buf = xs[rank].clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, op)
        assert pg.allreduce([buf], opts).wait() is True
        return buf

    results = _against_gloo(gloo, size, fn)
    if not isinstance(results[0], BaseException):
        assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_allgathers_match_gloo(gloo, gen, size: int, dtype: torch.dtype) -> None:
    xs = _inputs(gen, size, dtype, (3, 4))

    def fn(rank: int, pg: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        outs = [torch.empty_like(xs[0]) for _ in range(size)]
        pg.allgather([outs], [xs[rank]]).wait()
        flat = torch.empty(size * xs[0].numel(), dtype=dtype)
        pg._allgather_base(flat, xs[rank].view(-1)).wait()  # agreement.py: 1-D rows
        stacked = torch.empty(size * 3, 4, dtype=dtype)
        pg._allgather_base(stacked, xs[rank]).wait()
        return outs, flat, stacked

    for outs, flat, stacked in _against_gloo(gloo, size, fn):
        _same(outs, xs, "allgather")
        _same(flat, torch.cat([x.reshape(-1) for x in xs]), "_allgather_base 1-D")
        _same(stacked, torch.cat(xs), "_allgather_base 2-D")


@pytest.mark.parametrize(
    "call",
    [
        lambda pg, n: pg.allgather([[torch.empty(2)] * (n - 1)], [torch.ones(2)]),
        lambda pg, n: pg.allgather([[torch.empty(3)] * n], [torch.ones(2)]),
        lambda pg, n: pg._allgather_base(torch.empty(2 * n + 1), torch.ones(2)),
        lambda pg, n: pg._allgather_base(torch.empty(2 * n), torch.ones(1, 2)),
        lambda pg, n: pg.alltoall_base(
            torch.empty(n), torch.empty(n), [1] * n, [2] * n, dist.AllToAllOptions()
        ),
    ],
    ids=["count", "size", "base-numel", "base-shape", "splits"],
)
@pytest.mark.parametrize("size", SIZES)
def test_bad_arguments_match_gloo(gloo, size: int, call: Callable[[Any, int], Any]) -> None:
    """Rejected on every rank (at the call, or at wait for split sizes), with gloo's error."""
    results = _against_gloo(gloo, size, lambda rank, pg: call(pg, size).wait())
    assert all(isinstance(r, RuntimeError) for r in results), results


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_broadcast_and_gather_match_gloo(gloo, gen, size: int, dtype: torch.dtype) -> None:
    for root in range(size):
        xs = _inputs(gen, size, dtype, (6,))

        def fn(rank: int, pg: Any, root: int = root, xs: list[torch.Tensor] = xs) -> Any:
            buf = xs[rank].clone()
            bopts = dist.BroadcastOptions()
            bopts.rootRank = root
            pg.broadcast([buf], bopts).wait()
            gopts = dist.GatherOptions()
            gopts.rootRank = root
            outs = [torch.zeros_like(buf) for _ in range(size)] if rank == root else []
            pg.gather([outs] if outs else [], [xs[rank]], gopts).wait()
            return buf, outs

        for rank, (buf, outs) in enumerate(_against_gloo(gloo, size, fn)):
            _same(buf, xs[root], f"broadcast from {root} to {rank}")
            _same(outs, xs if rank == root else [], f"gather to {root} at {rank}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_alltoall_base_even_matches_gloo(gloo, gen, size: int, dtype: torch.dtype) -> None:
    xs = _inputs(gen, size, dtype, (2 * size, 3))

    def fn(rank: int, pg: Any) -> torch.Tensor:
        out = torch.empty_like(xs[rank])
        pg.alltoall_base(out, xs[rank], [], [], dist.AllToAllOptions()).wait()
        return out

    for j, out in enumerate(_against_gloo(gloo, size, fn)):
        _same(out, torch.cat([x.chunk(size)[j] for x in xs]), f"alltoall at {j}")


@pytest.mark.parametrize("size", SIZES)
def test_alltoall_base_explicit_splits_match_gloo(gloo, gen, size: int) -> None:
    sends = torch.randint(0, 4, (size, size), generator=gen)  # sends[i][j]: rows i -> j
    xs = [
        torch.randn(int(sends[i].sum()), 2, generator=gen, dtype=torch.float64) for i in range(size)
    ]

    def fn(rank: int, pg: Any) -> torch.Tensor:
        out = torch.empty(int(sends[:, rank].sum()), 2, dtype=torch.float64)
        ins, outs = sends[rank].tolist(), sends[:, rank].tolist()
        pg.alltoall_base(out, xs[rank], outs, ins, dist.AllToAllOptions()).wait()
        return out

    for j, out in enumerate(_against_gloo(gloo, size, fn)):
        want = [xs[i].split(sends[i].tolist())[j] for i in range(size)]
        _same(out, torch.cat(want), f"alltoall at {j}")


@pytest.mark.parametrize("size", SIZES)
def test_issue_order_matching_like_announce(gloo, gen, size: int) -> None:
    """The leader issues a broadcast, then an all-gather, then waits on both (agreement.py)."""
    desc = torch.randint(0, 256, (16,), generator=gen, dtype=torch.uint8)
    rows = _inputs(gen, size, torch.int64, (4,))

    def fn(rank: int, pg: Any) -> tuple[torch.Tensor, torch.Tensor]:
        slot = desc.clone() if rank == 0 else torch.zeros_like(desc)
        sent = pg.broadcast([slot], dist.BroadcastOptions())
        if rank:
            sent.wait()
        out = torch.empty(size, 4, dtype=torch.int64)
        work = pg._allgather_base(out.view(-1), rows[rank])
        sent.wait()
        work.wait()
        return slot, out

    for slot, out in _against_gloo(gloo, size, fn):
        _same(slot, desc, "descriptor")
        _same(out, torch.stack(rows), "rows")


@pytest.mark.parametrize("size", SIZES)
def test_worker_op_handlers_match_gloo(gloo, gen, size: int) -> None:
    """collective_ops itself over the fake world: what the fake is for."""
    xs = _inputs(gen, size, torch.float32, (size, 3))
    flags = _inputs(gen, size, torch.bool, (5,))

    def fn(rank: int, pg: Any) -> list[Any]:
        return [
            collective_ops.all_reduce(pg, xs[rank], ReduceOp.SUM, size),
            collective_ops.all_reduce(pg, flags[rank], ReduceOp.BXOR, size),
            collective_ops.all_reduce(pg, xs[rank].to(torch.complex64), ReduceOp.PRODUCT, size),
            collective_ops.all_gather(pg, xs[rank], size),
            collective_ops.broadcast(pg, xs[rank], 1, rank, torch.float32, (size, 3), xs[0].device),
            collective_ops.gather(pg, xs[rank], size, size - 1, rank),
            collective_ops.all_to_all(pg, xs[rank]),
        ]

    world = FakeWorld(size)
    fake = run_ranks(world, fn, timeout_s=20)
    real = run_ranks(gloo(size), fn, timeout_s=20)
    for rank in range(size):
        _same(fake[rank], real[rank], f"rank {rank}")
        assert dict(world.calls[rank]) == {
            "allreduce": 2,
            "allgather": 2,
            "broadcast": 1,
            "gather": 1,
            "alltoall_base": 1,
        }


@pytest.mark.parametrize("size", SIZES)
def test_announce_then_all_gather_rows_over_the_fake(gloo, size: int) -> None:
    """descriptor.announce(wait=False) + agreement.all_gather_rows(before=...): the leader
    waits on its broadcasts only after issuing the all-gather."""
    desc = worker_pb2.OpDescriptor(  # longer than one announcement slot
        op_id=7,
        kind=worker_pb2.OP_KIND_TRAIN_STEP,
        train_step=worker_pb2.TrainStepArgs(model="m", inputs="x" * 3000),
    )

    def fn(rank: int, pg: Any) -> tuple[bytes, torch.Tensor]:
        row = torch.full((4,), rank, dtype=torch.int64)
        if rank == 0:
            before = descriptor.announce(pg, desc, inline=5, wait=False)
            return desc.SerializeToString(), agreement.all_gather_rows(pg, row, size, before)
        got, inline = descriptor.receive(pg)
        assert inline == 5
        return got.SerializeToString(), agreement.all_gather_rows(pg, row, size)

    world = FakeWorld(size)
    for rank, (body, rows) in enumerate(run_ranks(world, fn, timeout_s=20)):
        assert body == desc.SerializeToString()
        assert torch.equal(rows, torch.arange(size).repeat_interleave(4).view(size, 4))
        assert dict(world.calls[rank]) == {"broadcast": 2, "_allgather_base": 1}
    _against_gloo(gloo, size, fn)


def test_float_reductions_fold_in_rank_order(gen) -> None:
    """Unrounded floats: the fake's result is ((x0 + x1) + x2), bit for bit, on every rank."""
    xs = [torch.randn(1000, generator=gen, dtype=torch.float32) for _ in range(3)]

    def fn(rank: int, pg: FakeProcessGroup) -> torch.Tensor:
        assert (pg.rank(), pg.size()) == (rank, 3)
        return _allreduce_of(pg, xs[rank])

    for result in run_ranks(FakeWorld(3), fn, timeout_s=5):
        assert torch.equal(result, (xs[0] + xs[1]) + xs[2])


# ---------------------------------------------------------------- failures
def _allreduce_of(pg: Any, t: torch.Tensor) -> torch.Tensor:
    buf = t.clone()
    pg.allreduce([buf], dist.AllreduceOptions()).wait()
    return buf


def _allreduce(pg: FakeProcessGroup, value: float = 1.0) -> torch.Tensor:
    return _allreduce_of(pg, torch.full((3,), value))


def test_fail_next_fails_one_op_then_recovers() -> None:
    world = FakeWorld(3)
    world.fail_next(1, ValueError("injected"))

    def fn(rank: int, pg: FakeProcessGroup) -> Any:
        try:
            _allreduce(pg)
        except Exception as exc:
            return exc, _allreduce(pg, rank)
        raise AssertionError("the injected failure did not happen")

    results = run_ranks(world, fn, timeout_s=5)
    for rank, (exc, after) in enumerate(results):
        if rank == 1:
            assert isinstance(exc, ValueError) and str(exc) == "injected"
        else:
            assert isinstance(exc, RuntimeError) and "Connection closed by peer" in str(exc)
        assert torch.equal(after, torch.full((3,), 3.0))
    assert [c["allreduce"] for c in world.calls] == [2, 2, 2]


def test_kill_fails_pending_and_later_ops_on_every_rank() -> None:
    world = FakeWorld(3)
    work = world.pg(0).broadcast([torch.zeros(2)], dist.BroadcastOptions())  # rank 0 waits
    world.kill(2)
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        work.wait()

    def later(rank: int, pg: FakeProcessGroup) -> BaseException | None:
        with pytest.raises(RuntimeError, match=r"rank 2 died") as info:
            _allreduce(pg)
        return info.value

    assert all(isinstance(r, RuntimeError) for r in run_ranks(world, later, timeout_s=5))


def test_mismatched_ops_raise_on_every_rank() -> None:
    def fn(rank: int, pg: FakeProcessGroup) -> Any:
        if rank == 1:
            return pg.broadcast([torch.zeros(3)], dist.BroadcastOptions()).wait()
        return _allreduce(pg)

    for result in run_ranks(FakeWorld(3), fn, timeout_s=5):
        assert isinstance(result, RuntimeError) and "mismatch" in str(result), result


def test_rank_that_never_arrives_times_out_the_others() -> None:
    timeout = 0.5
    world = FakeWorld(3, timeout_s=timeout)

    def fn(rank: int, pg: FakeProcessGroup) -> Any:
        if rank == 2:
            return None
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out") as info:
            _allreduce(pg)
        return time.monotonic() - start, str(info.value)

    t0 = time.monotonic()
    results = run_ranks(world, fn, timeout_s=timeout + 2)
    assert time.monotonic() - t0 < timeout + 1
    for elapsed, message in results[:2]:
        assert elapsed < timeout + 1 and "[2]" in message
    # The late rank finds its peers gone.
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _allreduce(world.pg(2))


def test_wait_timeout_argument_bounds_the_wait() -> None:
    work = FakeWorld(2).pg(0).allreduce([torch.ones(1)], dist.AllreduceOptions())
    start = time.monotonic()
    assert not work.is_completed()
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait(datetime.timedelta(seconds=0.2))
    assert time.monotonic() - start < 1.5 and work.is_completed()


def test_bad_arguments_raise_at_the_call_and_use_no_sequence_number() -> None:
    world = FakeWorld(2)
    with pytest.raises(RuntimeError, match="expected length 2, got 1"):
        world.pg(0).allgather([[torch.empty(2)]], [torch.ones(2)])
    with pytest.raises(RuntimeError, match="empty output on non-root"):
        world.pg(1).gather([[torch.empty(2)] * 2], [torch.ones(2)], dist.GatherOptions())
    assert world.calls[0]["allgather"] == 1 and world.calls[1]["gather"] == 1
    results = run_ranks(world, lambda rank, pg: _allreduce(pg, rank + 1), timeout_s=5)
    assert all(torch.equal(r, torch.full((3,), 3.0)) for r in results)


def test_run_ranks_names_a_stuck_rank() -> None:
    release = threading.Event()

    def fn(rank: int, pg: FakeProcessGroup) -> int:
        if rank == 1:
            release.wait(10)
        return rank

    try:
        with pytest.raises(AssertionError, match=r"rank\(s\) \[1\]"):
            run_ranks(FakeWorld(3), fn, timeout_s=0.3)
    finally:
        release.set()
    assert run_ranks(FakeWorld(2), fn, timeout_s=5) == [0, 1]
