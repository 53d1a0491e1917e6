"""The data-movement collectives of the contract (broadcast, all_gather, gather,
all_to_all, scatter, barrier) and 0-dim/empty tensors, on real local clusters
of 2 and 3 workers.

Each test puts fresh random tensors on every rank, runs one collective through
the SDK, reads every rank back with ``cluster.get`` and compares with what
torch computes locally on the same inputs (``helpers.reduce_oracle``).
Shared cases and helpers are in ``collective_cases``.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from collective_cases import TIMEOUT_S, parametrize_dtype, parametrize_out
from collective_cases import chunks as _chunks
from collective_cases import inputs as _inputs
from helpers import assert_tensor, get_each, make_input, put_each, reduce_oracle

import collectives

# ------------------------------------------------------------- data movement


@parametrize_dtype
def test_broadcast(cluster, gen, uname, dtype):
    n = cluster.world_size
    name = uname()
    inputs = _inputs(cluster, dtype, (3, 4), gen)
    put_each(cluster, name, inputs)
    src = n - 1

    assert cluster.broadcast(name, src=src, timeout=TIMEOUT_S) is None

    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, inputs[src], what=f"rank {rank}")


def test_broadcast_from_every_src(cluster, gen, uname):
    for src in range(cluster.world_size):
        name = uname(f"src{src}")
        inputs = _inputs(cluster, torch.int64, (5,), gen)
        put_each(cluster, name, inputs)
        cluster.broadcast(name, src=src, timeout=TIMEOUT_S)
        for rank, got in enumerate(get_each(cluster, name)):
            assert_tensor(got, inputs[src], what=f"src={src}, rank {rank}")


def test_broadcast_needs_the_tensor_only_on_src(cluster, gen, uname):
    """Other ranks' copies are created where absent, replaced where they differ."""
    n = cluster.world_size
    name = uname()
    src = n - 1
    t = make_input(torch.float32, (2, 3), gen)
    cluster.put(name, t, rank=src)
    if n > 2:
        # A different dtype and shape on rank 1: replaced, not an error.
        cluster.put(name, make_input(torch.int64, (7,), gen), rank=1)

    cluster.broadcast(name, src=src, timeout=TIMEOUT_S)

    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, t, what=f"rank {rank}")


@parametrize_dtype
@parametrize_out
def test_all_gather(cluster, gen, uname, dtype, use_out):
    n = cluster.world_size
    name = uname("in")
    out = uname("out") if use_out else None
    inputs = _inputs(cluster, dtype, (2, 3), gen)
    put_each(cluster, name, inputs)

    parts = cluster.all_gather(name, out=out, timeout=TIMEOUT_S)

    assert isinstance(parts, list) and len(parts) == n, f"expected a list of {n}, got {parts!r}"
    for rank, part in enumerate(parts):
        assert_tensor(part, inputs[rank], what=f"part {rank}")
    stacked = torch.stack(inputs)
    for rank, got in enumerate(get_each(cluster, out or name)):
        assert_tensor(got, stacked, what=f"stored on rank {rank}")
    if use_out:
        for rank, got in enumerate(get_each(cluster, name)):
            assert_tensor(got, inputs[rank], what=f"input on rank {rank} must be unchanged")


@parametrize_dtype
def test_gather(cluster, gen, uname, dtype):
    n = cluster.world_size
    name = uname()
    inputs = _inputs(cluster, dtype, (3,), gen)
    put_each(cluster, name, inputs)
    dst = n - 1

    parts = cluster.gather(name, dst=dst, timeout=TIMEOUT_S)

    assert isinstance(parts, list) and len(parts) == n, f"expected a list of {n}, got {parts!r}"
    for rank, part in enumerate(parts):
        assert_tensor(part, inputs[rank], what=f"part {rank}")
    stored = get_each(cluster, name)
    assert_tensor(stored[dst], torch.stack(inputs), what=f"stored on dst {dst}")
    for rank, got in enumerate(stored):
        if rank != dst:
            assert_tensor(got, inputs[rank], what=f"rank {rank} (not dst) must keep its input")


@parametrize_out
def test_gather_to_every_dst(cluster, gen, uname, use_out):
    n = cluster.world_size
    for dst in range(n):
        name = uname(f"in{dst}")
        out = uname(f"out{dst}") if use_out else None
        inputs = _inputs(cluster, torch.float32, (2, 2), gen)
        put_each(cluster, name, inputs)
        parts = cluster.gather(name, dst=dst, out=out, timeout=TIMEOUT_S)
        for rank, part in enumerate(parts):
            assert_tensor(part, inputs[rank], what=f"dst={dst}: part {rank}")
        assert_tensor(cluster.get(out or name, rank=dst), torch.stack(inputs), what=f"dst={dst}")
        for rank, got in enumerate(get_each(cluster, name)):
            if use_out or rank != dst:
                assert_tensor(got, inputs[rank], what=f"dst={dst}: input on rank {rank}")


@parametrize_dtype
@parametrize_out
def test_all_to_all(cluster, gen, uname, dtype, use_out):
    n = cluster.world_size
    name = uname("in")
    out = uname("out") if use_out else None
    inputs = _inputs(cluster, dtype, (2 * n, 3), gen)
    put_each(cluster, name, inputs)

    assert cluster.all_to_all(name, out=out, timeout=TIMEOUT_S) is None

    # Chunk j of rank i lands as chunk i of rank j.
    for j, got in enumerate(get_each(cluster, out or name)):
        expected = torch.cat([_chunks(inputs[i], n)[j] for i in range(n)])
        assert_tensor(got, expected, what=f"rank {j}")
    if use_out:
        for rank, got in enumerate(get_each(cluster, name)):
            assert_tensor(got, inputs[rank], what=f"input on rank {rank} must be unchanged")


@parametrize_dtype
def test_scatter(cluster, gen, uname, dtype):
    n = cluster.world_size
    name = uname()
    t = make_input(dtype, (2 * n + 1, 3), gen)  # not divisible: tensor_split semantics

    assert cluster.scatter(name, t, dim=0, timeout=TIMEOUT_S) is None

    expected = torch.tensor_split(t, n, dim=0)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, expected[rank].contiguous(), what=f"rank {rank}")


def test_barrier(cluster):
    assert cluster.barrier(timeout=TIMEOUT_S) is None
    assert cluster.barrier(timeout=TIMEOUT_S) is None


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_to_all"])
def test_dim0_not_divisible_is_invalid_argument(cluster, gen, uname, collective):
    n = cluster.world_size
    name = uname()
    inputs = _inputs(cluster, torch.float32, (2 * n + 1, 2), gen)
    put_each(cluster, name, inputs)

    with pytest.raises(collectives.InvalidArgument) as info:
        getattr(cluster, collective)(name, timeout=TIMEOUT_S)

    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(info.value, ValueError)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, inputs[rank], what=f"rank {rank} must be unchanged")


# -------------------------------------------------------- 0-dim, empty, shapes


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)], ids=["0-dim", "empty", "empty-3d"])
def test_zero_dim_and_empty_tensors(cluster, gen, uname, shape):
    n = cluster.world_size
    reduced, bcast, gathered = uname("ar"), uname("bc"), uname("ag")
    inputs = _inputs(cluster, torch.float32, shape, gen)
    for name in (reduced, bcast, gathered):
        put_each(cluster, name, inputs)

    cluster.all_reduce(reduced, op="sum", timeout=TIMEOUT_S)
    cluster.broadcast(bcast, src=n - 1, timeout=TIMEOUT_S)
    parts = cluster.all_gather(gathered, timeout=TIMEOUT_S)

    expected = reduce_oracle("sum", inputs)
    for rank in range(n):
        got = cluster.get(reduced, rank=rank)
        assert_tensor(got, expected, exact=False, what=f"all_reduce, rank {rank}")
        assert_tensor(cluster.get(bcast, rank=rank), inputs[-1], what=f"broadcast, rank {rank}")
        stacked = cluster.get(gathered, rank=rank)
        assert_tensor(stacked, torch.stack(inputs), what=f"all_gather, rank {rank}")
    for rank, part in enumerate(parts):
        assert_tensor(part, inputs[rank], what=f"all_gather part {rank}")


def test_reduce_scatter_of_0_dim_is_invalid_argument(cluster2, uname):
    name = uname()
    cluster2.put(name, torch.tensor(1.5))
    with pytest.raises(collectives.InvalidArgument):
        cluster2.reduce_scatter(name, timeout=TIMEOUT_S)
