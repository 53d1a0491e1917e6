"""Data placement: put/get/delete/scatter on real local clusters.

Round trips must be bit-exact for every dtype the wire format carries, for
0-dim, empty and non-contiguous tensors, and for a 1 GiB tensor (streamed in
chunks into one preallocated buffer on each side).
"""

from __future__ import annotations

import gc

import grpc
import pytest
import torch
from helpers import assert_tensor, get_each, make_input

import collectives

ALL_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
TIMEOUT_S = 30.0


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_dtype_id)
def test_put_get_round_trip_every_dtype(cluster, gen, uname, dtype):
    everywhere, each = uname("all"), uname("each")
    t = make_input(dtype, (3, 5), gen)
    per_rank = [make_input(dtype, (2, 7), gen) for _ in range(cluster.world_size)]

    cluster.put(everywhere, t, timeout=TIMEOUT_S)  # rank=None: the same tensor on every rank
    for rank, part in enumerate(per_rank):
        cluster.put(each, part, rank=rank, timeout=TIMEOUT_S)

    for rank in range(cluster.world_size):
        assert_tensor(cluster.get(everywhere, rank=rank, timeout=TIMEOUT_S), t, what=f"{rank}")
        assert_tensor(cluster.get(each, rank=rank), per_rank[rank], what=f"rank {rank}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(), (0,), (4, 0), (0, 3, 2)], ids=["0-dim", "empty", "empty-2d", "empty-3d"]
)
def test_zero_dim_and_empty(cluster2, gen, uname, dtype, shape):
    name = uname()
    t = make_input(dtype, shape, gen)
    cluster2.put(name, t)
    for rank in range(cluster2.world_size):
        assert_tensor(cluster2.get(name, rank=rank), t, what=f"rank {rank}")


NON_CONTIGUOUS = {
    "transposed": lambda g: torch.randn(4, 6, generator=g).t(),
    "step-slice": lambda g: torch.randn(10, 3, generator=g)[::3],
    "column": lambda g: torch.randn(5, 4, generator=g)[:, 2],
    "offset-narrow": lambda g: torch.randn(6, 6, generator=g)[1:4, 2:5],
    "permuted-3d": lambda g: torch.randint(0, 100, (2, 3, 4), generator=g).permute(2, 0, 1),
    "expanded": lambda g: torch.randn(3, 1, generator=g).expand(3, 4),
    "channels-last": lambda g: torch.randn(2, 3, 4, 5, generator=g).to(
        memory_format=torch.channels_last
    ),
    "bool-step": lambda g: torch.randint(0, 2, (9,), generator=g).bool()[1::2],
}


@pytest.mark.parametrize("make", NON_CONTIGUOUS.values(), ids=NON_CONTIGUOUS.keys())
def test_non_contiguous_inputs(cluster2, gen, uname, make):
    name, each = uname("all"), uname("each")
    t = make(gen)
    assert not t.is_contiguous()
    expected = t.contiguous()

    cluster2.put(name, t)
    cluster2.put(each, t, rank=1)

    for rank in range(cluster2.world_size):
        got = cluster2.get(name, rank=rank)
        assert_tensor(got, expected, what=f"rank {rank}")
    assert_tensor(cluster2.get(each, rank=1), expected, what="rank 1")


def test_put_does_not_keep_a_view_of_the_callers_tensor(cluster2, gen, uname):
    name = uname()
    t = make_input(torch.float32, (8,), gen)
    original = t.clone()
    cluster2.put(name, t, rank=0)
    t.add_(1.0)  # mutating the caller's tensor afterwards must not change the stored one
    assert_tensor(cluster2.get(name, rank=0), original)


def test_put_accepts_a_tensor_that_requires_grad(cluster2, gen, uname):
    name = uname()
    t = make_input(torch.float32, (3,), gen).requires_grad_()
    cluster2.put(name, t, rank=0)
    got = cluster2.get(name, rank=0)
    assert_tensor(got, t.detach())
    assert not got.requires_grad


def test_put_replaces(cluster, gen, uname):
    name = uname()
    cluster.put(name, make_input(torch.float32, (4,), gen))
    replacement = make_input(torch.int64, (2, 3), gen)
    cluster.put(name, replacement)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, replacement, what=f"rank {rank}")

    # Replacing on one rank leaves the others as they were.
    single = make_input(torch.bfloat16, (5,), gen)
    cluster.put(name, single, rank=0)
    assert_tensor(cluster.get(name, rank=0), single)
    for rank in range(1, cluster.world_size):
        assert_tensor(cluster.get(name, rank=rank), replacement, what=f"rank {rank}")


def test_names_are_case_sensitive_and_may_use_every_allowed_character(cluster2, gen, uname):
    base = uname()
    lower, upper = f"{base}/abc", f"{base}/ABC"
    a, b = make_input(torch.float32, (2,), gen), make_input(torch.float32, (2,), gen)
    cluster2.put(lower, a, rank=0)
    cluster2.put(upper, b, rank=0)
    assert_tensor(cluster2.get(lower, rank=0), a)
    assert_tensor(cluster2.get(upper, rank=0), b)

    odd = f"{base}/A-z_0.9:x/y"
    longest = (base + "/" + "n" * 256)[:256]
    for name in (odd, longest):
        cluster2.put(name, a, rank=1)
        assert_tensor(cluster2.get(name, rank=1), a, what=name)


# ---------------------------------------------------------------------- delete


def test_delete_everywhere(cluster, gen, uname):
    name = uname()
    cluster.put(name, make_input(torch.float32, (3,), gen))
    assert cluster.delete(name) is None
    for rank in range(cluster.world_size):
        with pytest.raises(collectives.CollectiveError) as info:
            cluster.get(name, rank=rank)
        assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_delete_one_rank(cluster, gen, uname):
    name = uname()
    t = make_input(torch.int64, (3,), gen)
    cluster.put(name, t)
    cluster.delete(name, rank=0)
    with pytest.raises(collectives.CollectiveError) as info:
        cluster.get(name, rank=0)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    for rank in range(1, cluster.world_size):
        assert_tensor(cluster.get(name, rank=rank), t, what=f"rank {rank} keeps it")


def test_delete_of_an_absent_name_is_not_found_unless_missing_ok(cluster2, uname):
    name = uname("never-put")
    with pytest.raises(collectives.CollectiveError) as info:
        cluster2.delete(name)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert name in info.value.message
    with pytest.raises(collectives.CollectiveError) as info:
        cluster2.delete(name, rank=1)
    assert info.value.code == grpc.StatusCode.NOT_FOUND

    assert cluster2.delete(name, missing_ok=True) is None
    assert cluster2.delete(name, rank=1, missing_ok=True) is None


def test_delete_everywhere_when_only_some_ranks_hold_it(cluster, gen, uname):
    name = uname()
    last = cluster.world_size - 1
    cluster.put(name, make_input(torch.float32, (2,), gen), rank=last)

    cluster.delete(name)  # exists somewhere: not an error

    with pytest.raises(collectives.CollectiveError) as info:
        cluster.get(name, rank=last)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(collectives.CollectiveError) as info:
        cluster.delete(name)  # now it exists nowhere
    assert info.value.code == grpc.StatusCode.NOT_FOUND


# --------------------------------------------------------------------- scatter


@pytest.mark.parametrize(
    ("shape", "dim"),
    [((6, 2), 0), ((7, 3), 0), ((2, 9), 1), ((3, 2, 5), 2), ((2, 4), 0)],
    ids=["even", "uneven", "dim1", "dim2", "fewer-rows-than-ranks-on-ws3"],
)
def test_scatter_tensor_split(cluster, gen, uname, shape, dim):
    n = cluster.world_size
    name = uname()
    t = make_input(torch.float32, shape, gen)

    cluster.scatter(name, t, dim=dim)

    for rank, (got, want) in enumerate(
        zip(get_each(cluster, name), torch.tensor_split(t, n, dim=dim), strict=True)
    ):
        assert_tensor(got, want.contiguous(), what=f"rank {rank}")


def test_scatter_with_chunk_sizes(cluster, gen, uname):
    n = cluster.world_size
    name = uname()
    sizes = [1, 4, 2][:n]
    t = make_input(torch.int64, (sum(sizes), 3), gen)

    cluster.scatter(name, t, dim=0, chunk_sizes=sizes)

    for rank, (got, want) in enumerate(
        zip(get_each(cluster, name), torch.split(t, sizes, dim=0), strict=True)
    ):
        assert_tensor(got, want, what=f"rank {rank}")


def test_scatter_with_chunk_sizes_along_dim1_and_an_empty_chunk(cluster2, gen, uname):
    name = uname()
    t = make_input(torch.float64, (2, 5), gen)
    cluster2.scatter(name, t, dim=1, chunk_sizes=[5, 0])
    assert_tensor(cluster2.get(name, rank=0), t)
    assert_tensor(cluster2.get(name, rank=1), t[:, 5:].contiguous())


@pytest.mark.parametrize(
    "sizes", [[3], [1, 1, 1, 1], [2, 2], [4, -1]], ids=["too-few", "too-many", "bad-sum", "neg"]
)
def test_scatter_with_bad_chunk_sizes_is_invalid_argument(cluster2, gen, uname, sizes):
    name = uname()
    t = make_input(torch.float32, (3, 2), gen)
    with pytest.raises(collectives.InvalidArgument) as info:
        cluster2.scatter(name, t, dim=0, chunk_sizes=sizes)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(info.value, ValueError)
    for rank in range(cluster2.world_size):  # nothing was stored
        with pytest.raises(collectives.CollectiveError) as missing:
            cluster2.get(name, rank=rank)
        assert missing.value.code == grpc.StatusCode.NOT_FOUND


# --------------------------------------------------------------------- 1 GiB


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_gib_round_trip_is_bit_exact(cluster2, seed, uname):
    """1 GiB of random bits (NaN payloads included) survives put and get."""
    name = uname("gib")
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (2**28,), dtype=torch.int32, generator=gen)
    t = bits.view(torch.float32).view(2**14, 2**14)  # 2**28 * 4 bytes = 1 GiB
    assert t.numel() * t.element_size() == 2**30
    try:
        cluster2.put(name, t, rank=1, timeout=300)
        got = cluster2.get(name, rank=1, timeout=300)
        assert got.dtype == torch.float32 and got.shape == t.shape
        # Compare the bits, so NaNs compare too.
        assert torch.equal(got.view(torch.int32), t.view(torch.int32)), "1 GiB round trip differs"
    finally:
        del t, bits
        got = None
        gc.collect()
        cluster2.delete(name, missing_ok=True)
