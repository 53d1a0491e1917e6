"""The ring reductions of large sums, averages and products (``worker/ring_reductions.py``).

Real gloo groups, one per rank thread over one ``HashStore``, as the workers' data
groups (gloo point-to-point sends); fresh random operands of 1 MiB and more, sizes
that do not divide evenly by the group, against what torch computes locally on the
same inputs. Float operands are random multiples of 1/16 (sums, averages) or random
signed powers of two (products), so every order of reduction gives the same bits and
the results must equal torch's exactly (an average: the exact sum divided once). The
operand is only read: it is checked to be unchanged. Over ``tests/fake_pg.py``'s world,
the calls show which path ran and a dead peer fails the op on the others with the
operand intact.
"""

from __future__ import annotations

import functools
import operator
import time
from typing import Any

import pytest
import torch
from fake_pg import FakeWorld, run_ranks
from gloo_world import GlooWorlds, gloo_groups

from collectives.reduce_ops import ReduceOp
from collectives_server.worker.kernels import collective_ops
from collectives_server.worker.kernels.ring_reductions import RING_MIN_BYTES

SIZES = (2, 3, 4)
DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8)
RING_OPS = {ReduceOp.SUM: operator.add, ReduceOp.PRODUCT: operator.mul, ReduceOp.AVG: operator.add}


@pytest.fixture(scope="module")
def gloo() -> GlooWorlds:
    """``gloo(size)``: a world of real gloo groups, built once per size for the module."""
    return GlooWorlds(timeout_s=20)


def _operand(gen: torch.Generator, dtype: torch.dtype, op: ReduceOp, numel: int) -> torch.Tensor:
    if dtype.is_floating_point:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            return torch.randn(numel, generator=gen, dtype=dtype).mul(16).round().div(16)
        exponent = torch.randint(-3, 4, (numel,), generator=gen).to(dtype)
        sign = torch.randint(0, 2, (numel,), generator=gen).to(dtype).mul(2).sub(1)
        return sign * torch.pow(2.0, exponent).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), generator=gen, dtype=dtype)
    return torch.randint(-1000, 1001, (numel,), generator=gen, dtype=dtype)


def _numel(dtype: torch.dtype, size: int) -> int:
    """Just over the ring's threshold, and not a multiple of the group's size."""
    numel = RING_MIN_BYTES // dtype.itemsize + 1
    return numel + (1 if numel % size == 0 else 0)


# An average is for floating dtypes only (validation refuses the others).
CASES = [
    (d, op) for d in DTYPES for op in RING_OPS if d.is_floating_point or op is not ReduceOp.AVG
]


@pytest.mark.parametrize(("dtype", "op"), CASES, ids=[f"{d}-{o.name}" for d, o in CASES])
@pytest.mark.parametrize("size", SIZES)
def test_large_reductions_equal_torchs_on_every_rank(
    gloo, gen, size: int, dtype: torch.dtype, op: ReduceOp
) -> None:
    numel = _numel(dtype, size)
    xs = [_operand(gen, dtype, op, numel).view(-1, 1) for _ in range(size)]
    before = [x.clone() for x in xs]
    expected = functools.reduce(RING_OPS[op], xs)
    if op is ReduceOp.AVG:
        expected = expected / size

    results = run_ranks(
        gloo(size), lambda r, pg: collective_ops.all_reduce(pg, xs[r], op, size), timeout_s=60
    )
    for rank, got in enumerate(results):
        assert isinstance(got, torch.Tensor), f"rank {rank}: {got!r}"
        assert got.dtype == dtype and got.shape == (numel, 1)
        assert torch.equal(got, expected), f"rank {rank}"
        assert torch.equal(xs[rank], before[rank]), f"rank {rank}'s operand was written"
        assert got.untyped_storage().data_ptr() != xs[rank].untyped_storage().data_ptr()


@pytest.mark.parametrize("op", list(RING_OPS), ids=lambda o: o.name)
@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter_of_a_large_operand_keeps_each_ranks_part(
    gloo, gen, size: int, op: ReduceOp
) -> None:
    """Half a ring: each rank sends and receives ``size - 1`` parts, once each."""
    rows = size * 70_000  # 4 columns of float32: over 1 MiB per rank
    xs = [_operand(gen, torch.float32, op, rows * 4).view(rows, 4) for _ in range(size)]
    before = [x.clone() for x in xs]
    total = functools.reduce(RING_OPS[op], xs)
    if op is ReduceOp.AVG:
        total = total / size

    def fn(rank: int, pg: Any) -> torch.Tensor:
        return collective_ops.reduce_scatter(pg, xs[rank], op, size, rank)

    for rank, got in enumerate(run_ranks(gloo(size), fn, timeout_s=60)):
        assert isinstance(got, torch.Tensor), f"rank {rank}: {got!r}"
        assert got.shape == (rows // size, 4) and got.is_contiguous()
        assert torch.equal(got, total.chunk(size)[rank]), f"rank {rank}"
        assert torch.equal(xs[rank], before[rank]), f"rank {rank}'s operand was written"
    world = FakeWorld(size, timeout_s=30)
    fake = run_ranks(world, fn, timeout_s=60)
    for rank in range(size):
        assert torch.equal(fake[rank], total.chunk(size)[rank])
        assert dict(world.calls[rank]) == {"send": size - 1, "recv": size - 1}


@pytest.mark.parametrize("op", list(RING_OPS), ids=lambda o: o.name)
@pytest.mark.parametrize("size", SIZES)
def test_reduce_of_a_large_operand_sends_each_part_to_the_root_once(
    gloo, gen, size: int, op: ReduceOp
) -> None:
    numel = _numel(torch.float64, size)
    xs = [_operand(gen, torch.float64, op, numel).view(-1, 1) for _ in range(size)]
    before = [x.clone() for x in xs]
    total = functools.reduce(RING_OPS[op], xs)
    if op is ReduceOp.AVG:
        total = total / size
    root = size - 1

    def fn(rank: int, pg: Any) -> torch.Tensor | None:
        return collective_ops.reduce(pg, xs[rank], op, size, root=root)

    for ranks in (run_ranks(gloo(size), fn, timeout_s=60), run_ranks(FakeWorld(size), fn)):
        for rank, got in enumerate(ranks):
            if rank == root:
                assert isinstance(got, torch.Tensor) and torch.equal(got, total), got
            else:
                assert got is None, f"rank {rank}: {got!r}"
            assert torch.equal(xs[rank], before[rank]), f"rank {rank}'s operand was written"
    world = FakeWorld(size)
    run_ranks(world, fn)
    for rank in range(size):
        sends, recvs = size - 1, size - 1  # the reduce-scatter half of the ring
        if rank == root:
            recvs += size - 1  # every other member's part
        else:
            sends += 1  # its own part, to the root
        assert dict(world.calls[rank]) == {"send": sends, "recv": recvs}


@pytest.mark.parametrize(
    ("nbytes", "dtype", "op", "ring"),
    [
        (RING_MIN_BYTES, torch.float32, ReduceOp.SUM, True),
        (RING_MIN_BYTES, torch.float64, ReduceOp.AVG, True),
        (RING_MIN_BYTES - 4, torch.float32, ReduceOp.SUM, False),
        (RING_MIN_BYTES, torch.float32, ReduceOp.MAX, False),
        (RING_MIN_BYTES, torch.float16, ReduceOp.SUM, False),
        (RING_MIN_BYTES, torch.complex64, ReduceOp.SUM, False),
    ],
    ids=["ring", "avg", "below-threshold", "max", "float16", "complex"],
)
def test_which_path_runs(gen, nbytes: int, dtype: torch.dtype, op: ReduceOp, ring: bool) -> None:
    """Only large sums and products of the plain dtypes take the ring; the rest copy
    the operand and run gloo's all-reduce, with the same results."""
    size = 3
    numel = nbytes // dtype.itemsize
    xs = [torch.randn(numel, generator=gen).to(dtype) for _ in range(size)]
    world = FakeWorld(size, timeout_s=30)
    results = run_ranks(
        world, lambda r, pg: collective_ops.all_reduce(pg, xs[r], op, size), timeout_s=60
    )
    for rank in range(size):
        assert isinstance(results[rank], torch.Tensor), results[rank]
        assert torch.equal(results[rank], results[0])
        calls = dict(world.calls[rank])
        if ring:
            assert calls == {"send": 2 * (size - 1), "recv": 2 * (size - 1)}
        else:
            assert calls.get("allreduce", 0) + calls.get("allgather", 0) == 1, calls
            assert "send" not in calls


def test_a_dead_peer_fails_the_ring_on_every_other_rank_and_leaves_operands_as_they_were(
    gen,
) -> None:
    size = 3
    numel = _numel(torch.float32, size)
    xs = [_operand(gen, torch.float32, ReduceOp.SUM, numel) for _ in range(size)]
    before = [x.clone() for x in xs]
    world = FakeWorld(size, timeout_s=10)
    world.kill(2)

    def fn(rank: int, pg: Any) -> Any:
        if rank == 2:
            return None  # dead: it never calls
        return collective_ops.all_reduce(pg, xs[rank], ReduceOp.SUM, size)

    results = run_ranks(world, fn, timeout_s=30)
    for rank in (0, 1):
        assert isinstance(results[rank], RuntimeError), results[rank]
        assert "rank 2" in str(results[rank])
        assert torch.equal(xs[rank], before[rank])


def test_a_silent_peer_fails_the_ring_within_the_groups_timeout(gen) -> None:
    """A stopped peer (it never sends or receives) fails the op at the group's timeout
    on real gloo, as gloo's own all_reduce would: nothing waits longer."""
    timeout_s = 1.5
    pgs = gloo_groups(2, timeout_s)
    x = _operand(gen, torch.float32, ReduceOp.SUM, _numel(torch.float32, 2))
    before = x.clone()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?i)timed out|timeout"):
        collective_ops.all_reduce(pgs[0], x, ReduceOp.SUM, 2)
    assert time.monotonic() - started < timeout_s + 5.0
    assert torch.equal(x, before)
