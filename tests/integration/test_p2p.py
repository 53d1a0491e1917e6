"""Point to point (``send``, ``exchange``), ``destroy_group`` and group ``scatter`` on
real local clusters of 2 and 3 workers.

Each test puts fresh random tensors on the ranks (dtypes and shapes differ per
source where it matters), runs one call through the SDK, reads every rank back
and compares bit for bit with what torch holds locally: each dst must hold its
src's tensor as the src held it *before* the op, every other value unchanged.
The server's own argument checks are driven with raw gRPC (``env``).
"""

from __future__ import annotations

import re

import grpc
import pytest
import torch
from collective_cases import TIMEOUT_S, dtype_id
from helpers import make_input, put_each
from raw_grpc import Env, opts

import collectives
from collectives.v1 import worker_pb2

DTYPES = (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool, torch.complex64)
SHAPES = ((3, 4), (7,), (), (2, 1, 5))


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bytes (NaN-safe, -0.0 distinct: bit for bit)."""
    assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{what}: {got.dtype}{got.shape}"
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
        f"{what}: values differ\n{got}\n{want}"
    )


def _mixed(n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """One tensor per rank, each of another dtype and shape."""
    return [make_input(DTYPES[r % len(DTYPES)], SHAPES[r % len(SHAPES)], gen) for r in range(n)]


def _absent(cluster, name: str, rank: int) -> None:
    with pytest.raises(collectives.NotFound):
        cluster.get(name, rank=rank)


# ------------------------------------------------------------ send
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_send_moves_the_src_tensor_bit_for_bit_and_the_src_keeps_it(cluster, gen, uname, dtype):
    n = cluster.world_size
    name = uname()
    inputs = [make_input(dtype, (5, 3), gen) for _ in range(n)]
    put_each(cluster, name, inputs)
    src, dst = n - 1, 0  # the leader receives

    assert cluster.send(name, src=src, dst=dst, timeout=TIMEOUT_S) is None

    _same(cluster.get(name, rank=dst), inputs[src], f"dst {dst}")
    for rank in range(1, n):
        _same(cluster.get(name, rank=rank), inputs[rank], f"rank {rank} (src or not named)")


def test_send_under_out_leaves_the_dst_input_and_others_untouched(cluster3, gen, uname):
    name, out = uname(), uname("out")
    inputs = _mixed(3, gen)
    put_each(cluster3, name, inputs)

    cluster3.send(name, src=0, dst=2, out=out, timeout=TIMEOUT_S)

    _same(cluster3.get(out, rank=2), inputs[0], "dst 2 under out")
    for rank in range(3):
        _same(cluster3.get(name, rank=rank), inputs[rank], f"rank {rank}'s input")
    _absent(cluster3, out, 0)
    _absent(cluster3, out, 1)


def test_send_of_a_larger_tensor_to_a_dst_that_held_nothing(cluster2, gen, uname):
    name = uname()
    big = torch.randn(1 << 20, generator=gen)  # 4 MiB
    cluster2.put(name, big, rank=0)

    cluster2.send(name, src=0, dst=1, timeout=TIMEOUT_S)

    _same(cluster2.get(name, rank=1), big, "dst 1")


# ------------------------------------------------------------ exchange
@pytest.mark.parametrize("out", [None, "out"], ids=["in-place", "out"])
def test_ring_shift_over_three_ranks_leaves_rank_j_what_rank_j_minus_1_held(
    cluster3, gen, uname, out
):
    name = uname()
    out_name = uname(out) if out else None
    inputs = _mixed(3, gen)  # a different dtype and shape on every rank
    put_each(cluster3, name, inputs)

    cluster3.exchange(name, pairs=[(0, 1), (1, 2), (2, 0)], out=out_name, timeout=TIMEOUT_S)

    for rank in range(3):
        _same(cluster3.get(out_name or name, rank=rank), inputs[rank - 1], f"rank {rank}")
        if out_name:
            _same(cluster3.get(name, rank=rank), inputs[rank], f"rank {rank}'s input")


def test_exchange_swap_on_two_ranks(cluster2, gen, uname):
    name = uname()
    inputs = _mixed(2, gen)
    put_each(cluster2, name, inputs)

    cluster2.exchange(name, pairs=[(1, 0), (0, 1)], timeout=TIMEOUT_S)

    _same(cluster2.get(name, rank=0), inputs[1], "rank 0")
    _same(cluster2.get(name, rank=1), inputs[0], "rank 1")


def test_exchange_one_src_to_two_dsts_and_only_the_srcs_need_the_tensor(cluster3, gen, uname):
    name, out = uname(), uname("out")
    src = make_input(torch.int64, (4, 4), gen)
    cluster3.put(name, src, rank=1)

    cluster3.exchange(name, pairs=[(1, 0), (1, 2)], out=out, timeout=TIMEOUT_S)

    for rank in (0, 2):
        _same(cluster3.get(out, rank=rank), src, f"dst {rank}")
    _absent(cluster3, out, 1)


def test_async_send_and_exchange_return_handles_whose_result_is_none(cluster3, gen, uname):
    a, b = uname("a"), uname("b")
    xs, ys = _mixed(3, gen), [make_input(torch.float32, (6,), gen) for _ in range(3)]
    put_each(cluster3, a, xs)
    put_each(cluster3, b, ys)

    h_send = cluster3.send(a, src=2, dst=1, async_op=True, timeout=TIMEOUT_S)
    h_ring = cluster3.exchange(b, pairs=[(0, 2), (2, 0)], async_op=True, timeout=TIMEOUT_S)
    assert isinstance(h_send, collectives.Work) and isinstance(h_ring, collectives.Work)
    assert h_send.result(timeout=TIMEOUT_S) is None
    assert h_ring.wait(timeout=TIMEOUT_S) is None and h_ring.done()

    _same(cluster3.get(a, rank=1), xs[2], "send dst 1")
    _same(cluster3.get(b, rank=0), ys[2], "exchange dst 0")
    _same(cluster3.get(b, rank=2), ys[0], "exchange dst 2")
    _same(cluster3.get(b, rank=1), ys[1], "rank 1 not named")


# ------------------------------------------------------------ sub-groups
def test_send_and_exchange_on_a_sub_group_use_global_ranks(cluster3, gen, uname):
    name = uname()
    inputs = _mixed(3, gen)
    put_each(cluster3, name, inputs)
    group = cluster3.new_group([2, 1])
    try:
        cluster3.exchange(name, pairs=[(1, 2), (2, 1)], group=group, timeout=TIMEOUT_S)
        _same(cluster3.get(name, rank=1), inputs[2], "member 1")
        _same(cluster3.get(name, rank=2), inputs[1], "member 2")
        _same(cluster3.get(name, rank=0), inputs[0], "non-member 0")

        cluster3.send(name, src=2, dst=1, out=name + "-s", group=group, timeout=TIMEOUT_S)
        _same(cluster3.get(name + "-s", rank=1), inputs[1], "member 1 after the send")
        with pytest.raises(collectives.InvalidArgument, match="not a member of the group"):
            cluster3.send(name, src=0, dst=1, group=group)
        with pytest.raises(collectives.InvalidArgument, match=r"dst 0 .* not a member"):
            cluster3.exchange(name, pairs=[(1, 2), (2, 0)], group=group, async_op=True)
    finally:
        cluster3.destroy_group(group, timeout=TIMEOUT_S)


# ------------------------------------------------------------ errors
INVALID = {
    "src_is_dst": ([(1, 1)], "sends rank 1 to itself"),
    "out_of_range": ([(0, 3)], "dst 3 is out of range"),
    "negative": ([(-1, 0)], "src -1 is out of range"),
    "dst_twice": ([(0, 2), (1, 2)], "named in more than one pair"),
    "empty": ([], "pairs is empty"),
    "not_pairs": ([0, 1], "must be a (src, dst) pair"),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_pairs_raise_invalid_argument_at_the_call(cluster3, uname, case):
    pairs, words = INVALID[case]
    name = uname()
    for async_op in (False, True):
        with pytest.raises(collectives.InvalidArgument, match=re.escape(words)) as info:
            cluster3.exchange(name, pairs=pairs, async_op=async_op)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    if len(pairs) == 1 and len(pairs[0]) == 2:
        with pytest.raises(collectives.InvalidArgument, match=re.escape(words)):
            cluster3.send(name, src=pairs[0][0], dst=pairs[0][1])


def test_missing_on_every_src_is_not_found_and_on_some_failed_precondition(cluster3, gen, uname):
    name = uname()
    with pytest.raises(collectives.NotFound) as info:
        cluster3.send(name, src=1, dst=0, timeout=TIMEOUT_S)
    assert info.value.code == grpc.StatusCode.NOT_FOUND and "any src rank (1)" in info.value.message

    inputs = _mixed(3, gen)
    cluster3.put(name, inputs[0], rank=0)
    with pytest.raises(collectives.FailedPrecondition) as info:
        cluster3.exchange(name, pairs=[(0, 1), (2, 0)], timeout=TIMEOUT_S)
    err = info.value
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{name!r} is missing on src rank(s) 2 but present on src rank(s) 0" in err.message
    assert err.ranks == (2,)
    _same(cluster3.get(name, rank=0), inputs[0], "rank 0 unchanged")  # nothing committed
    _absent(cluster3, name, 1)


RAW_INVALID = {
    "src_is_dst": ([(0, 0)], 0, "to itself"),
    "out_of_range": ([(0, 2)], 0, "dst 2 is out of range"),
    "dst_twice": ([(0, 1), (0, 1)], 0, "named in more than one pair"),
    "empty": ([], 0, "pairs is empty"),
}


@pytest.mark.parametrize("case", RAW_INVALID)
def test_the_leader_checks_pairs_itself(env: Env, case: str) -> None:
    pairs, group_id, words = RAW_INVALID[case]
    request = worker_pb2.ExchangeRequest(
        options=opts(group_id=group_id),
        name=env.name(),
        pairs=[worker_pb2.ExchangePair(src=s, dst=d) for s, d in pairs],
    )
    with pytest.raises(grpc.RpcError) as info:
        env.leader.Exchange(request, timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


def test_the_leader_refuses_unknown_groups_and_group_zero(env: Env) -> None:
    pairs = [worker_pb2.ExchangePair(src=0, dst=1)]
    request = worker_pb2.ExchangeRequest(options=opts(group_id=987), name=env.name(), pairs=pairs)
    with pytest.raises(grpc.RpcError) as info:
        env.leader.Exchange(request, timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "group 987 does not exist in generation" in info.value.details()
    for group_id, code in ((0, grpc.StatusCode.INVALID_ARGUMENT), (987, grpc.StatusCode.NOT_FOUND)):
        destroy = worker_pb2.DestroyGroupRequest(options=opts(group_id=group_id))
        with pytest.raises(grpc.RpcError) as info:
            env.leader.DestroyGroup(destroy, timeout=TIMEOUT_S)
        assert info.value.code() == code, info.value.details()


# ------------------------------------------------------------ destroy_group
def test_destroy_group_then_every_use_is_not_found(cluster3, gen, uname):
    name = uname()
    inputs = _mixed(3, gen)
    put_each(cluster3, name, inputs)
    group = cluster3.new_group([0, 1])
    cluster3.send(name, src=0, dst=1, out=name + "-before", group=group, timeout=TIMEOUT_S)

    assert cluster3.destroy_group(group, timeout=TIMEOUT_S) is None

    uses = {
        "send": lambda: cluster3.send(name, src=0, dst=1, group=group, timeout=TIMEOUT_S),
        "exchange": lambda: cluster3.exchange(name, [(1, 0)], group=group, timeout=TIMEOUT_S),
        "all_reduce": lambda: cluster3.all_reduce(name + "-f", group=group, timeout=TIMEOUT_S),
        "barrier": lambda: cluster3.barrier(group=group, timeout=TIMEOUT_S),
        "scatter": lambda: cluster3.scatter(name, torch.zeros(2), group=group),
        "destroy again": lambda: cluster3.destroy_group(group, timeout=TIMEOUT_S),
    }
    for what, use in uses.items():
        with pytest.raises(collectives.NotFound) as info:
            use()
        assert info.value.code == grpc.StatusCode.NOT_FOUND, what
        if what != "scatter":
            assert f"group {group.id} does not exist in generation" in info.value.message, what
    _same(cluster3.get(name + "-before", rank=1), inputs[0], "the send before the destroy")
    _same(cluster3.get(name, rank=1), inputs[1], "nothing ran after it")


def test_an_async_op_queued_before_destroy_group_runs_and_one_after_is_not_found(
    cluster3, gen, uname
):
    name = uname()
    inputs = [make_input(torch.float32, (3,), gen) for _ in range(3)]
    put_each(cluster3, name, inputs)
    group = cluster3.new_group([1, 2])
    before = cluster3.all_reduce(name, group=group, async_op=True, timeout=TIMEOUT_S)
    cluster3.destroy_group(group, timeout=TIMEOUT_S)  # ordered after the all_reduce
    before.wait(timeout=TIMEOUT_S)
    after = cluster3.send(name, src=1, dst=2, group=group, async_op=True, timeout=TIMEOUT_S)
    with pytest.raises(collectives.NotFound):
        after.result(timeout=TIMEOUT_S)
    for rank in (1, 2):
        torch.testing.assert_close(cluster3.get(name, rank=rank), inputs[1] + inputs[2])


def test_destroy_group_needs_a_group(cluster2):
    for bad in (None, 0, "g"):
        with pytest.raises(collectives.InvalidArgument, match="world group cannot be destroyed"):
            cluster2.destroy_group(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------ group scatter
@pytest.mark.parametrize("members", [[0, 2], [1, 2], [0, 1, 2]], ids=str)
def test_group_scatter_sends_chunks_to_members_in_ascending_global_rank(
    cluster3, gen, uname, members
):
    name = uname()
    olds = [make_input(torch.int16, (2,), gen) for _ in range(3)]
    put_each(cluster3, name, olds)
    group = cluster3.new_group(list(reversed(members)))
    t = make_input(torch.bfloat16, (5, 3), gen)
    try:
        cluster3.scatter(name, t, timeout=TIMEOUT_S, group=group)
        parts = torch.tensor_split(t, len(members))
        for i, rank in enumerate(members):
            _same(cluster3.get(name, rank=rank), parts[i], f"member {rank}")
        for rank in set(range(3)) - set(members):
            _same(cluster3.get(name, rank=rank), olds[rank], f"non-member {rank}")

        sizes = [4] + [0] * (len(members) - 2) + [1]
        cluster3.scatter(name, t, dim=0, chunk_sizes=sizes, group=group)
        for rank, part in zip(members, torch.split(t, sizes), strict=True):
            _same(cluster3.get(name, rank=rank), part, f"member {rank} with chunk_sizes")
        bad = [1] * (len(members) + 1)
        with pytest.raises(collectives.InvalidArgument, match=f"the group size is {len(members)}"):
            cluster3.scatter(name, t, chunk_sizes=bad, group=group)
    finally:
        cluster3.destroy_group(group, timeout=TIMEOUT_S)
