"""Every collective of the contract, on real local clusters of 2 and 3 workers.

Each test puts fresh random tensors on every rank, runs one collective through
the SDK, reads every rank back with ``cluster.get`` and compares with what
torch computes locally on the same inputs (``helpers.reduce_oracle``).
Parametrized over every valid (dtype, ReduceOp) pair; the invalid pairs must
be ``INVALID_ARGUMENT`` and leave the operands unchanged.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from helpers import (
    REDUCE_OPS,
    assert_tensor,
    get_each,
    make_input,
    op_valid,
    put_each,
    reduce_oracle,
)

import collectives

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool)
REDUCE_CASES = [(d, op) for d in DTYPES for op in REDUCE_OPS if op_valid(op, d)]
INVALID_CASES = [(d, op) for d in DTYPES for op in REDUCE_OPS if not op_valid(op, d)]
TIMEOUT_S = 30.0


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _case_id(value: object) -> str:
    """pytest ids for (dtype, op) cases: it passes each value separately."""
    return _dtype_id(value) if isinstance(value, torch.dtype) else str(value)


def _exact(dtype: torch.dtype, op: str) -> bool:
    """Integer/bool results and float min/max are exact; float arithmetic is not."""
    return not dtype.is_floating_point or op in ("min", "max")


def _inputs(cluster, dtype, shape, gen) -> list[torch.Tensor]:
    return [make_input(dtype, shape, gen) for _ in range(cluster.world_size)]


def _chunks(t: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    assert t.shape[0] % parts == 0
    return torch.chunk(t, parts, dim=0)


parametrize_reduce = pytest.mark.parametrize(("dtype", "op"), REDUCE_CASES, ids=_case_id)
parametrize_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
parametrize_out = pytest.mark.parametrize("use_out", [False, True], ids=["in-place", "out"])


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
