"""Every path an op can take on the workers, through the SDK on real clusters.

Operands up to ``INLINE_MAX_BYTES`` per rank travel inside the operand
exchange and every rank computes its result from them; larger ones take a data
collective and an outcome agreement, and sums and products of ``RING_MIN_BYTES``
or more a ring all-reduce that reads the operand in place.
``test_collectives`` covers every op and dtype on small tensors (the inline
path); this module runs the same checks on operands just above each limit, on
an operand that is small on the leader but large on the src, and checks
read-your-writes on a follower right after each call (no barrier per op:
followers fence the result).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_tensor, get_each, make_input, put_each, reduce_oracle

from collectives_server.worker.engine.handlers.tensor_ops import INLINE_MAX_BYTES
from collectives_server.worker.kernels.ring_reductions import RING_MIN_BYTES

TIMEOUT_S = 60.0
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64)


def _large_shape(dtype: torch.dtype, world: int) -> tuple[int, int]:
    """Just above the inline limit, dim 0 divisible by the world size (2 or 3)."""
    assert 6 % world == 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    cols = INLINE_MAX_BYTES // (6 * itemsize) + 1
    return (6, cols)


def _ops(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["sum", "product"]
    if dtype.is_complex:
        return ["sum", "product"]
    if dtype.is_floating_point:
        return ["sum", "max", "avg"]
    return ["sum", "bxor"]


def _exact(dtype: torch.dtype, op: str) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex) or op in ("min", "max")


CASES = [(d, op) for d in DTYPES for op in _ops(d)]
CASE_IDS = [f"{d}-{o}".replace("torch.", "") for d, o in CASES]


def _all_reduce_checked(cluster, name: str, out: str, op: str, inputs) -> tuple:
    """``all_reduce(name, out=out)`` against torch's result on every rank, every rank's
    bits the same and the operand left as it was; returns (torch's result, rank 0's)."""
    dtype = inputs[0].dtype
    expected = reduce_oracle(op, inputs)
    cluster.all_reduce(name, op=op, out=out, timeout=TIMEOUT_S)
    results = get_each(cluster, out)
    for rank, got in enumerate(results):
        assert_tensor(got, expected, exact=_exact(dtype, op), what=f"{op} rank {rank}")
        assert torch.equal(got, results[0])
    assert all(torch.equal(a, b) for a, b in zip(get_each(cluster, name), inputs, strict=True))
    return expected, results[0]


@pytest.mark.parametrize(("dtype", "op"), CASES, ids=CASE_IDS)
def test_large_all_reduce_and_reduce(cluster, gen, uname, dtype, op) -> None:
    name, out = uname(), uname("out")
    inputs = [
        make_input(dtype, _large_shape(dtype, cluster.world_size), gen)
        for _ in range(cluster.world_size)
    ]
    put_each(cluster, name, inputs)
    expected, _ = _all_reduce_checked(cluster, name, out, op, inputs)
    dst = cluster.world_size - 1
    got = cluster.reduce(name, dst=dst, op=op, out=out + "/r", timeout=TIMEOUT_S)
    assert_tensor(got, expected, exact=_exact(dtype, op), what="reduce")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=["float64", "int32"])
def test_ring_sized_sums_averages_and_products(cluster, gen, uname, dtype) -> None:
    """Over ``RING_MIN_BYTES`` per rank, with a row count the world does not divide:
    all_reduce (to ``out`` and in place), reduce and reduce_scatter against torch's
    result, every rank's bits the same, the operand left as it was."""
    world = cluster.world_size
    cols = 64
    rows = RING_MIN_BYTES // (cols * dtype.itemsize) + 1
    rows += 1 if rows % world == 0 else 0
    name, out = uname(), uname("out")
    for op in ("sum", "product", "avg") if dtype.is_floating_point else ("sum", "product"):
        inputs = [make_input(dtype, (rows, cols), gen) for _ in range(world)]
        if op == "product" and dtype.is_floating_point:  # powers of two: exact in any order
            inputs = [torch.pow(2.0, (t * 2).round().clamp(-4, 4)).to(dtype) for t in inputs]
        put_each(cluster, name, inputs)
        _, result = _all_reduce_checked(cluster, name, out, op, inputs)
        got = cluster.reduce(name, dst=world - 1, op=op, out=out + "/r", timeout=TIMEOUT_S)
        assert torch.equal(got, result)
        cluster.all_reduce(name, op=op, timeout=TIMEOUT_S)
        assert all(torch.equal(got, result) for got in get_each(cluster, name))

    even = rows - rows % world
    inputs = [make_input(dtype, (even, cols), gen) for _ in range(world)]
    put_each(cluster, name, inputs)
    cluster.reduce_scatter(name, op="sum", out=out + "/rs", timeout=TIMEOUT_S)
    total = reduce_oracle("sum", inputs)
    for rank, got in enumerate(get_each(cluster, out + "/rs")):
        assert_tensor(got, total.chunk(world)[rank], exact=_exact(dtype, "sum"))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_large_data_movement(cluster, gen, uname, dtype) -> None:
    world = cluster.world_size
    name = uname()
    inputs = [make_input(dtype, _large_shape(dtype, world), gen) for _ in range(world)]
    put_each(cluster, name, inputs)
    stacked = torch.stack(inputs)

    parts = cluster.all_gather(name, out=name + "/ag", timeout=TIMEOUT_S)
    assert torch.equal(torch.stack(list(parts)), stacked)
    for got in get_each(cluster, name + "/ag"):
        assert torch.equal(got, stacked)

    parts = cluster.gather(name, dst=world - 1, out=name + "/g", timeout=TIMEOUT_S)
    assert torch.equal(torch.stack(list(parts)), stacked)

    cluster.all_to_all(name, out=name + "/a2a", timeout=TIMEOUT_S)
    for rank, got in enumerate(get_each(cluster, name + "/a2a")):
        want = torch.cat([inp.chunk(world)[rank] for inp in inputs])
        assert torch.equal(got, want)

    if dtype != torch.bool:
        cluster.reduce_scatter(name, op="sum", out=name + "/rs", timeout=TIMEOUT_S)
        total = reduce_oracle("sum", inputs)
        for rank, got in enumerate(get_each(cluster, name + "/rs")):
            assert_tensor(got, total.chunk(world)[rank], exact=_exact(dtype, "sum"))

    cluster.broadcast(name, src=world - 1, timeout=TIMEOUT_S)
    for got in get_each(cluster, name):
        assert torch.equal(got, inputs[-1])


def test_broadcast_of_a_src_operand_larger_than_the_leaders(cluster2, gen, uname) -> None:
    """The leader sizes inline data from its own copy; the src's is far larger, so every
    rank falls back to the data collective together."""
    name = uname()
    cluster2.put(name, torch.zeros(3), rank=0)
    big = torch.randn(INLINE_MAX_BYTES // 2, generator=gen)
    cluster2.put(name, big, rank=1)
    cluster2.broadcast(name, src=1, timeout=TIMEOUT_S)
    for got in get_each(cluster2, name):
        assert torch.equal(got, big)


@pytest.mark.parametrize("numel", [4, INLINE_MAX_BYTES // 4 + 4], ids=["inline", "collective"])
def test_every_rank_reads_the_result_right_after_the_call(cluster, uname, numel) -> None:
    """The leader answers once it has committed; the followers' commits may come a
    moment later, and a read there waits for them (a fence), never seeing the
    value from before the op. Values change every iteration."""
    name, out = uname(), uname("out")
    world = cluster.world_size
    last = world - 1
    for i in range(40):
        for rank in range(world):
            cluster.put(name, torch.full((numel,), float(i + rank)), rank=rank)
        want = torch.full((numel,), float(world * i + world * (world - 1) // 2))
        cluster.all_reduce(name, op="sum", out=out, timeout=TIMEOUT_S)
        assert torch.equal(cluster.get(out, rank=last), want), f"iteration {i}"
        # reduce returns what the SDK reads from dst right after the call.
        got = cluster.reduce(name, dst=last, op="sum", out=out + "/r", timeout=TIMEOUT_S)
        assert torch.equal(got, want), f"iteration {i}"
        parts = cluster.all_gather(name, out=out + "/g", timeout=TIMEOUT_S)
        assert [float(p[0]) for p in parts] == [float(i + r) for r in range(world)]
