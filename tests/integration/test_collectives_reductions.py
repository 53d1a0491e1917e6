"""The reductions of the contract (all_reduce, reduce, reduce_scatter), on real
local clusters of 2 and 3 workers.

Each test puts fresh random tensors on every rank, runs one collective through
the SDK, reads every rank back with ``cluster.get`` and compares with what
torch computes locally on the same inputs (``helpers.reduce_oracle``).
Parametrized over every valid (dtype, ReduceOp) pair; the invalid pairs must
be ``INVALID_ARGUMENT`` and leave the operands unchanged. Shared cases and
helpers are in ``collective_cases``.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from collective_cases import INVALID_CASES, TIMEOUT_S, parametrize_reduce
from collective_cases import case_id as _case_id
from collective_cases import chunks as _chunks
from collective_cases import exact as _exact
from collective_cases import inputs as _inputs
from helpers import assert_tensor, get_each, put_each, reduce_oracle

import collectives

# ------------------------------------------------------------------ reductions


@parametrize_reduce
def test_all_reduce(cluster, gen, uname, dtype, op):
    name = uname()
    inputs = _inputs(cluster, dtype, (5, 3), gen)
    put_each(cluster, name, inputs)

    assert cluster.all_reduce(name, op=op, timeout=TIMEOUT_S) is None

    expected = reduce_oracle(op, inputs)
    results = get_each(cluster, name)
    for rank, got in enumerate(results):
        assert_tensor(got, expected, exact=_exact(dtype, op), what=f"rank {rank}")
        # Replicas must be bit-identical to each other, whatever the rounding.
        assert torch.equal(got, results[0]), f"rank {rank} differs from rank 0"


@parametrize_reduce
def test_reduce(cluster, gen, uname, dtype, op):
    name = uname()
    inputs = _inputs(cluster, dtype, (4, 2), gen)
    put_each(cluster, name, inputs)
    dst = cluster.world_size - 1

    # The enum form of the op (the string form is covered by test_all_reduce).
    result = cluster.reduce(name, dst=dst, op=collectives.ReduceOp[op.upper()], timeout=TIMEOUT_S)

    expected = reduce_oracle(op, inputs)
    assert_tensor(result, expected, exact=_exact(dtype, op), what="returned")
    stored = get_each(cluster, name)
    assert torch.equal(stored[dst], result), "the stored result differs from the returned one"
    for rank, got in enumerate(stored):
        if rank != dst:
            assert_tensor(got, inputs[rank], what=f"rank {rank} (not dst) must keep its input")


@parametrize_reduce
def test_reduce_scatter(cluster, gen, uname, dtype, op):
    n = cluster.world_size
    name = uname()
    inputs = _inputs(cluster, dtype, (2 * n, 3), gen)
    put_each(cluster, name, inputs)

    assert cluster.reduce_scatter(name, op=op, timeout=TIMEOUT_S) is None

    expected = _chunks(reduce_oracle(op, inputs), n)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, expected[rank], exact=_exact(dtype, op), what=f"rank {rank}")


def test_reduce_scatter_out_leaves_input(cluster, gen, uname):
    n = cluster.world_size
    name, out = uname("in"), uname("out")
    inputs = _inputs(cluster, torch.float32, (3 * n, 2), gen)
    put_each(cluster, name, inputs)

    assert cluster.reduce_scatter(name, op="max", out=out, timeout=TIMEOUT_S) is None

    expected = _chunks(reduce_oracle("max", inputs), n)
    for rank in range(n):
        assert_tensor(cluster.get(out, rank=rank), expected[rank], what=f"out on rank {rank}")
        assert_tensor(cluster.get(name, rank=rank), inputs[rank], what=f"input on rank {rank}")


def test_op_defaults_to_sum(cluster, gen, uname):
    name = uname()
    inputs = _inputs(cluster, torch.int64, (6,), gen)
    put_each(cluster, name, inputs)

    cluster.all_reduce(name, timeout=TIMEOUT_S)
    expected = reduce_oracle("sum", inputs)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, expected, what=f"rank {rank}")

    result = cluster.reduce(name, dst=0, timeout=TIMEOUT_S)
    assert_tensor(result, expected * cluster.world_size, what="reduce with the default op")


def test_reduce_to_every_dst(cluster, gen, uname):
    for dst in range(cluster.world_size):
        name = uname(f"dst{dst}")
        inputs = _inputs(cluster, torch.float64, (3,), gen)
        put_each(cluster, name, inputs)
        result = cluster.reduce(name, dst=dst, op="sum", timeout=TIMEOUT_S)
        expected = reduce_oracle("sum", inputs)
        assert_tensor(result, expected, exact=False, what=f"dst={dst} returned")
        stored = get_each(cluster, name)
        assert_tensor(stored[dst], result, what=f"dst={dst} stored")
        for rank, got in enumerate(stored):
            if rank != dst:
                assert_tensor(got, inputs[rank], what=f"dst={dst}: rank {rank} keeps its input")


@pytest.mark.parametrize("collective", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize(("dtype", "op"), INVALID_CASES, ids=_case_id)
def test_reduce_op_invalid_for_dtype(cluster2, gen, uname, collective, dtype, op):
    cluster = cluster2
    name = uname()
    inputs = _inputs(cluster, dtype, (2 * cluster.world_size,), gen)
    put_each(cluster, name, inputs)
    kwargs = {"dst": 0} if collective == "reduce" else {}

    with pytest.raises(collectives.InvalidArgument) as info:
        getattr(cluster, collective)(name, op=op, timeout=TIMEOUT_S, **kwargs)

    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert op in info.value.message.lower(), f"message does not name the op: {info.value}"
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, inputs[rank], what=f"rank {rank} must be unchanged")
