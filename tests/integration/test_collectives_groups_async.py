"""Sub-groups (``new_group``) and async handles (``async_op=True``) for the
collectives of the contract, on real local clusters of 2 and 3 workers.

Each test puts fresh random tensors on every rank, runs one collective through
the SDK, reads every rank back with ``cluster.get`` and compares with what
torch computes locally on the same inputs (``helpers.reduce_oracle``).
Shared cases and helpers are in ``collective_cases``.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from collective_cases import TIMEOUT_S
from collective_cases import case_id as _case_id
from collective_cases import chunks as _chunks
from collective_cases import exact as _exact
from collective_cases import inputs as _inputs
from helpers import assert_tensor, get_each, make_input, put_each, reduce_oracle

import collectives

# ----------------------------------------------------------------- sub-groups

GROUPS = [[0, 2], [0, 1], [1, 2]]
parametrize_group = pytest.mark.parametrize("members", GROUPS, ids=lambda m: f"g{m[0]}{m[1]}")


def _non_members(cluster, members):
    return [r for r in range(cluster.world_size) if r not in members]


@parametrize_group
@pytest.mark.parametrize(
    ("dtype", "op"),
    [(torch.float32, "sum"), (torch.int64, "max"), (torch.bfloat16, "avg"), (torch.uint8, "bxor")],
    ids=_case_id,
)
def test_group_all_reduce(cluster3, gen, uname, members, dtype, op):
    cluster = cluster3
    name = uname()
    inputs = _inputs(cluster, dtype, (4,), gen)
    put_each(cluster, name, inputs)
    group = cluster.new_group(members)

    cluster.all_reduce(name, op=op, group=group, timeout=TIMEOUT_S)

    expected = reduce_oracle(op, [inputs[r] for r in members])
    for rank in members:
        got = cluster.get(name, rank=rank)
        assert_tensor(got, expected, exact=_exact(dtype, op), what=f"member {rank}")
    for rank in _non_members(cluster, members):
        assert_tensor(cluster.get(name, rank=rank), inputs[rank], what=f"non-member {rank}")


@parametrize_group
def test_group_broadcast(cluster3, gen, uname, members):
    cluster = cluster3
    name = uname()
    inputs = _inputs(cluster, torch.float64, (2, 2), gen)
    put_each(cluster, name, inputs)
    src = members[-1]  # a global rank that is not the group's first member

    cluster.broadcast(name, src=src, group=cluster.new_group(members), timeout=TIMEOUT_S)

    for rank in members:
        assert_tensor(cluster.get(name, rank=rank), inputs[src], what=f"member {rank}")
    for rank in _non_members(cluster, members):
        assert_tensor(cluster.get(name, rank=rank), inputs[rank], what=f"non-member {rank}")


@parametrize_group
def test_group_reduce(cluster3, gen, uname, members):
    cluster = cluster3
    name = uname()
    inputs = _inputs(cluster, torch.int64, (5,), gen)
    put_each(cluster, name, inputs)
    dst = members[-1]

    result = cluster.reduce(
        name, dst=dst, op="product", group=cluster.new_group(members), timeout=TIMEOUT_S
    )

    expected = reduce_oracle("product", [inputs[r] for r in members])
    assert_tensor(result, expected, what="returned")
    for rank, got in enumerate(get_each(cluster, name)):
        want = expected if rank == dst else inputs[rank]
        assert_tensor(got, want, what=f"rank {rank}")


@parametrize_group
def test_group_all_gather(cluster3, gen, uname, members):
    cluster = cluster3
    name = uname()
    inputs = _inputs(cluster, torch.float32, (3,), gen)
    put_each(cluster, name, inputs)

    parts = cluster.all_gather(name, group=cluster.new_group(members), timeout=TIMEOUT_S)

    assert isinstance(parts, list) and len(parts) == len(members)
    for part, rank in zip(parts, members, strict=True):
        assert_tensor(part, inputs[rank], what=f"part of rank {rank}")
    stacked = torch.stack([inputs[r] for r in members])
    for rank in members:
        assert_tensor(cluster.get(name, rank=rank), stacked, what=f"member {rank}")
    for rank in _non_members(cluster, members):
        assert_tensor(cluster.get(name, rank=rank), inputs[rank], what=f"non-member {rank}")


@parametrize_group
def test_group_gather(cluster3, gen, uname, members):
    cluster = cluster3
    name = uname()
    inputs = _inputs(cluster, torch.int64, (2, 2), gen)
    put_each(cluster, name, inputs)
    dst = members[-1]

    parts = cluster.gather(name, dst=dst, group=cluster.new_group(members), timeout=TIMEOUT_S)

    assert len(parts) == len(members)
    for part, rank in zip(parts, members, strict=True):
        assert_tensor(part, inputs[rank], what=f"part of rank {rank}")
    stacked = torch.stack([inputs[r] for r in members])
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, stacked if rank == dst else inputs[rank], what=f"rank {rank}")


@parametrize_group
def test_group_reduce_scatter(cluster3, gen, uname, members):
    cluster = cluster3
    name = uname()
    inputs = _inputs(cluster, torch.float64, (2 * len(members), 3), gen)
    put_each(cluster, name, inputs)

    cluster.reduce_scatter(name, op="sum", group=cluster.new_group(members), timeout=TIMEOUT_S)

    # "Rank i" is the i-th member in ascending global-rank order.
    chunks = _chunks(reduce_oracle("sum", [inputs[r] for r in members]), len(members))
    for i, rank in enumerate(sorted(members)):
        got = cluster.get(name, rank=rank)
        assert_tensor(got, chunks[i], exact=False, what=f"member {rank}")
    for rank in _non_members(cluster, members):
        assert_tensor(cluster.get(name, rank=rank), inputs[rank], what=f"non-member {rank}")


@parametrize_group
def test_group_all_to_all(cluster3, gen, uname, members):
    cluster = cluster3
    name = uname()
    k = len(members)
    inputs = _inputs(cluster, torch.uint8, (2 * k,), gen)
    put_each(cluster, name, inputs)

    cluster.all_to_all(name, group=cluster.new_group(members), timeout=TIMEOUT_S)

    ordered = sorted(members)
    for j, rank in enumerate(ordered):
        expected = torch.cat([_chunks(inputs[i], k)[j] for i in ordered])
        assert_tensor(cluster.get(name, rank=rank), expected, what=f"member {rank}")
    for rank in _non_members(cluster, members):
        assert_tensor(cluster.get(name, rank=rank), inputs[rank], what=f"non-member {rank}")


def test_group_barrier(cluster3):
    assert cluster3.barrier(group=cluster3.new_group([0, 2]), timeout=TIMEOUT_S) is None


def test_group_src_dst_must_be_members(cluster3, gen, uname):
    cluster = cluster3
    name = uname()
    put_each(cluster, name, _inputs(cluster, torch.float32, (2,), gen))
    group = cluster.new_group([0, 2])
    with pytest.raises(collectives.InvalidArgument):
        cluster.broadcast(name, src=1, group=group, timeout=TIMEOUT_S)
    with pytest.raises(collectives.InvalidArgument):
        cluster.reduce(name, dst=1, group=group, timeout=TIMEOUT_S)
    with pytest.raises(collectives.InvalidArgument):
        cluster.gather(name, dst=1, group=group, timeout=TIMEOUT_S)


@pytest.mark.parametrize("ranks", [[0, 3], [-1, 0], [1, 1]], ids=["too-big", "negative", "dup"])
def test_new_group_with_bad_ranks_is_invalid_argument(cluster3, ranks):
    with pytest.raises(collectives.InvalidArgument) as info:
        cluster3.new_group(ranks)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


# --------------------------------------------------------------- async handles


def test_async_handles_return_what_sync_calls_return(cluster, gen, uname):
    n = cluster.world_size
    red, ag, ar = uname("reduce"), uname("all_gather"), uname("all_reduce")
    inputs = _inputs(cluster, torch.float32, (4,), gen)
    for name in (red, ag, ar):
        put_each(cluster, name, inputs)

    h_reduce = cluster.reduce(red, dst=0, op="max", async_op=True)
    h_gather = cluster.all_gather(ag, async_op=True)
    h_reduce_all = cluster.all_reduce(ar, op="min", async_op=True)

    expected_max = reduce_oracle("max", inputs)
    assert_tensor(h_reduce.result(timeout=TIMEOUT_S), expected_max, what="reduce .result()")
    assert_tensor(h_reduce.wait(timeout=TIMEOUT_S), expected_max, what="reduce .wait()")
    parts = h_gather.wait(timeout=TIMEOUT_S)
    assert isinstance(parts, list) and len(parts) == n
    for rank, part in enumerate(parts):
        assert_tensor(part, inputs[rank], what=f"all_gather part {rank}")
    assert len(h_gather.result(timeout=TIMEOUT_S)) == n
    assert h_reduce_all.result(timeout=TIMEOUT_S) is None
    assert h_reduce_all.wait(timeout=TIMEOUT_S) is None
    for handle in (h_reduce, h_gather, h_reduce_all):
        assert handle.done()
        assert handle.exception() is None
    for rank, got in enumerate(get_each(cluster, ar)):
        assert_tensor(got, reduce_oracle("min", inputs), what=f"all_reduce min, rank {rank}")


def test_many_async_ops_in_flight(cluster, gen, uname):
    n = cluster.world_size
    inputs = {}
    names = {
        kind: uname(kind) for kind in ("ar1", "ar2", "reduce", "bcast", "gather", "rs", "a2a", "ag")
    }
    for kind, name in names.items():
        inputs[kind] = _inputs(cluster, torch.int64, (2 * n, 2), gen)
        put_each(cluster, name, inputs[kind])

    handles = {
        "ar1": cluster.all_reduce(names["ar1"], op="sum", async_op=True),
        "ar2": cluster.all_reduce(names["ar2"], op="bor", async_op=True),
        "reduce": cluster.reduce(names["reduce"], dst=n - 1, op="min", async_op=True),
        "bcast": cluster.broadcast(names["bcast"], src=1, async_op=True),
        "gather": cluster.gather(names["gather"], dst=0, async_op=True),
        "rs": cluster.reduce_scatter(names["rs"], op="sum", async_op=True),
        "a2a": cluster.all_to_all(names["a2a"], async_op=True),
        "ag": cluster.all_gather(names["ag"], async_op=True),
        "barrier": cluster.barrier(async_op=True),
    }
    results = {kind: h.result(timeout=TIMEOUT_S) for kind, h in handles.items()}
    assert all(h.done() for h in handles.values())

    for rank in range(n):
        assert_tensor(cluster.get(names["ar1"], rank=rank), reduce_oracle("sum", inputs["ar1"]))
        assert_tensor(cluster.get(names["ar2"], rank=rank), reduce_oracle("bor", inputs["ar2"]))
        assert_tensor(cluster.get(names["bcast"], rank=rank), inputs["bcast"][1])
        rs = _chunks(reduce_oracle("sum", inputs["rs"]), n)[rank]
        assert_tensor(cluster.get(names["rs"], rank=rank), rs, what=f"reduce_scatter {rank}")
        a2a = torch.cat([_chunks(inputs["a2a"][i], n)[rank] for i in range(n)])
        assert_tensor(cluster.get(names["a2a"], rank=rank), a2a, what=f"all_to_all {rank}")
        assert_tensor(cluster.get(names["ag"], rank=rank), torch.stack(inputs["ag"]))
    assert_tensor(results["reduce"], reduce_oracle("min", inputs["reduce"]), what="reduce")
    for rank, part in enumerate(results["gather"]):
        assert_tensor(part, inputs["gather"][rank], what=f"gather part {rank}")
    for kind in ("ar1", "ar2", "bcast", "rs", "a2a", "barrier"):
        assert results[kind] is None, f"{kind} must return None, got {results[kind]!r}"


def test_async_server_error_surfaces_in_the_handle(cluster2, uname):
    missing = uname("missing")
    handle = cluster2.all_reduce(missing, async_op=True)

    exc = handle.exception(timeout=TIMEOUT_S)
    assert isinstance(exc, collectives.CollectiveError), f"expected a CollectiveError, got {exc!r}"
    assert exc.code == grpc.StatusCode.NOT_FOUND
    assert missing in exc.message
    assert handle.done()
    with pytest.raises(collectives.CollectiveError):
        handle.result(timeout=TIMEOUT_S)


def test_async_argument_error_raises_at_the_call(cluster2, gen, uname):
    name = uname()
    cluster2.put(name, make_input(torch.float32, (2,), gen))
    with pytest.raises(collectives.InvalidArgument):
        cluster2.all_reduce(name, op="median", async_op=True)
    with pytest.raises(collectives.InvalidArgument):
        cluster2.reduce(name, dst=cluster2.world_size, async_op=True)
