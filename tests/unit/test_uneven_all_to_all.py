"""all_to_all with ``split_sizes`` without a network: the matrix check the SDK and
the servicer share (``op_args.check_split_matrix``), the SDK refusing a bad
matrix before any RPC (fake servers), and the handler (``handlers/uneven_ops``)
on N threads over the in-memory fake process group (``handler_world``): results
against torch computed locally on the same seeded inputs, validation failing
identically on every rank with nothing committed, and a broken transport
breaking the group everywhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from fake_pg import FakeWorld
from handler_world import EXCHANGE, TIMEOUT_S, Cluster
from helpers import assert_tensor, make_input
from sdk_fakes import FakeDeployment, start_deployment
from sdk_fakes import invalid as _invalid

import collectives
from collectives.errors import CollectiveError, InvalidArgument
from collectives.v1 import worker_pb2
from collectives.wire.op_args import check_split_matrix, split_rows
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine.op_context import GroupBroken, OpResult

Matrix = list[list[int]]


# ------------------------------------------------------------ the matrix check
def test_a_valid_matrix_comes_back_as_lists_of_ints() -> None:
    got = check_split_matrix(((2, np.int64(1)), [0, torch.tensor(3)]), 2)
    assert got == [[2, 1], [0, 3]] and all(type(v) is int for row in got for v in row)


@pytest.mark.parametrize(
    ("matrix", "words"),
    [
        ([[1, 2]], "must be a 2 x 2 matrix (the group's size); got 1 rows"),
        ([[1, 2], [3, 4], [5, 6]], "got 3 rows"),
        ([[1, 2], [3]], "row 1 has 1 entries"),
        ([[1, 2], [3, 4, 5]], "row 1 has 3 entries"),
        ([[1, -1], [0, 0]], "split_sizes[0][1] is -1; row counts cannot be negative"),
        ([[1, 0], [2.0, 0]], "split_sizes[1][0] must be an int, got float"),
        ([[True, 0], [0, 0]], "split_sizes[0][0] must be an int, got bool"),
        ([[1, 0], "ab"], "split_sizes[1] must be a list of ints, got str"),
        ("ab", "must be a list of lists of ints, got str"),
        (None, "got NoneType"),
        ([[1 << 62, 0], [0, 0]], "no tensor has that many rows"),
    ],
    ids=lambda v: str(v)[:24],
)
def test_a_bad_matrix_is_invalid_argument(matrix: Any, words: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_split_matrix(matrix, 2)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.message


def test_the_wire_form_is_row_major_and_a_short_one_is_named() -> None:
    assert split_rows([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(InvalidArgument, match="row 1 has 1 entries"):
        check_split_matrix(split_rows([1, 2, 3], 2), 2)


# ------------------------------------------------------------ the SDK, fake servers
@pytest.fixture
def deployment() -> Iterator[FakeDeployment]:
    d = start_deployment(world_size=2)
    yield d
    d.stop()


def test_the_sdk_checks_the_matrix_against_the_group_before_any_rpc(
    deployment: FakeDeployment,
) -> None:
    with collectives.connect(deployment.coordinator_address, timeout=10) as cluster:
        _invalid(cluster.all_to_all, "x", split_sizes=[[1]], match="2 x 2")
        _invalid(cluster.all_to_all, "x", split_sizes=[], async_op=True, match="got 0 rows")
        _invalid(cluster.all_to_all, "x", split_sizes=[[1, -2], [0, 0]], match="negative")
        group = cluster.new_group([1])
        _invalid(cluster.all_to_all, "x", split_sizes=[[1, 0], [0, 1]], group=group, match="1 x 1")
        assert not deployment.fake.requests["AllToAll"]
        assert cluster.all_to_all("x", out="y", split_sizes=[[2, 1], [0, 3]]) is None
        assert cluster.all_to_all("x", split_sizes=[[4]], group=group) is None
        assert cluster.all_to_all("x") is None
    sent = deployment.fake.requests["AllToAll"]
    assert [list(r.split_sizes) for r in sent] == [[2, 1, 0, 3], [4], []]
    assert sent[0].out == "y" and sent[1].options.group_id == group.id


# ------------------------------------------------------------ the handler
def oracle(xs: dict[int, torch.Tensor], members: list[int], matrix: Matrix, j: int):
    """What member ``j`` stores: torch.cat of chunk i->j for every member i, in order."""
    return torch.cat([torch.split(xs[m], matrix[i])[j] for i, m in enumerate(members)], 0)


def make_inputs(
    members: list[int], matrix: Matrix, dtype: torch.dtype, row: tuple[int, ...], seed: int
) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {m: make_input(dtype, (sum(matrix[i]), *row), gen) for i, m in enumerate(members)}


def run(cl: Cluster, matrix: Matrix, group_id: int = 0, out: str = "") -> list[Any]:
    desc = worker_pb2.OpDescriptor(
        kind=OpKind.ALL_TO_ALL_UNEVEN,
        group_id=group_id,
        uneven=worker_pb2.UnevenAllToAllArgs(
            name="x", out=out, split_sizes=[n for r in matrix for n in r]
        ),
    )
    return cl.run(desc)


def check(
    cl: Cluster,
    xs: dict[int, torch.Tensor],
    matrix: Matrix,
    group_id: int = 0,
    out: str = "",
    data: FakeWorld | None = None,
) -> None:
    members = cl.ctxs[0].groups[group_id].ranks
    before = {r: x.clone() for r, x in xs.items()}
    cl.put("x", xs)
    results = run(cl, matrix, group_id, out)
    target = out or "x"
    moves = any(any(row) for row in matrix) and xs[members[0]][0:1].numel() > 0
    for r, res in enumerate(results):
        assert isinstance(res, OpResult), f"rank {r}: {res!r}"
        assert (res.result_name, res.result_ranks) == (target, members)
        assert res.shape == tuple(oracle(xs, members, matrix, 0).shape)
        got = cl.ctxs[r].store.peek(target)
        if r in members:
            assert_tensor(got, oracle(xs, members, matrix, members.index(r)), what=f"rank {r}")
        if out and r in xs:
            assert torch.equal(cl.ctxs[r].store.peek("x"), before[r]), f"rank {r}'s input"
        moved = Counter({"alltoall_base": 1} if moves and r in members else {})
        if data is None:
            assert cl.calls[r] == Counter({EXCHANGE: 2}) + moved, f"rank {r}: {cl.calls[r]}"
        else:
            assert cl.calls[r] == Counter({EXCHANGE: 2}), f"rank {r}: {cl.calls[r]}"


MATRICES = {
    2: [[2, 1], [0, 3]],
    3: [[1, 0, 2], [0, 0, 0], [4, 0, 1]],  # rank 1 sends nothing and receives nothing
}
DTYPES = [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", [2, 3])
def test_every_member_gets_its_column_in_member_order(
    size: int, dtype: torch.dtype, seed: int
) -> None:
    cl = Cluster(size)
    matrix = MATRICES[size]
    check(cl, make_inputs(list(range(size)), matrix, dtype, (3, 2), seed), matrix, out="y")


def test_large_rows_in_place_and_a_replaced_value(seed: int) -> None:
    cl = Cluster(3)
    matrix = [[5, 0, 100], [1, 1, 1], [0, 64, 0]]
    cl.put("x", {r: torch.zeros(7) for r in range(3)})  # another shape: replaced
    check(cl, make_inputs([0, 1, 2], matrix, torch.float32, (300,), seed), matrix)


@pytest.mark.parametrize("matrix", [[[0, 0], [0, 0]], [[0, 2], [0, 0]]], ids=["nothing", "to-one"])
def test_zero_rows_everywhere_or_to_one_member(matrix: Matrix, seed: int) -> None:
    """Nothing at all to move: no data collective; a member with an empty column
    stores a tensor of dim 0 == 0."""
    cl = Cluster(2)
    check(cl, make_inputs([0, 1], matrix, torch.int64, (4,), seed), matrix, out="y")


def test_rows_of_zero_bytes(seed: int) -> None:
    cl = Cluster(2)
    check(cl, make_inputs([0, 1], [[1, 2], [3, 0]], torch.float32, (0, 2), seed), [[1, 2], [3, 0]])


@pytest.mark.parametrize("ranks", [[0, 2], [1, 2]], ids=["with-leader", "without-leader"])
def test_a_sub_group_and_the_outsider_stores_nothing(ranks: list[int], seed: int) -> None:
    cl = Cluster(3)
    sub = FakeWorld(2, TIMEOUT_S)
    cl.add_group(1, ranks, sub)
    (outsider,) = set(range(3)) - set(ranks)
    mine = torch.ones(5)
    cl.ctxs[outsider].store.put("x", mine)
    matrix = [[1, 3], [2, 0]]
    check(cl, make_inputs(ranks, matrix, torch.float32, (2,), seed), matrix, 1, "y", sub)
    assert sub.calls[0]["alltoall_base"] == sub.calls[1]["alltoall_base"] == 1
    assert cl.ctxs[outsider].store.peek("x") is mine
    assert cl.ctxs[outsider].store.peek("y") is None


# ------------------------------------------------------------ validation
F32 = torch.float32
VALIDATION = {
    "row_sum": ({1: (F32, (4, 2))}, grpc.StatusCode.INVALID_ARGUMENT,
                "rank 1 (member 1) has 4 rows in dim 0 but its row of split_sizes sums to 3"),
    "dims_after_0": ({2: (F32, (3, 5))}, grpc.StatusCode.FAILED_PRECONDITION,
                     "disagrees across ranks"),
    "dtype": ({0: (torch.int64, (3, 2))}, grpc.StatusCode.FAILED_PRECONDITION,
              "rank 0: int64[3, 2]"),
    "zero_dim": ({1: (F32, ())}, grpc.StatusCode.INVALID_ARGUMENT, "0-dim on rank(s) 1"),
    "missing_on_one": ({1: None}, grpc.StatusCode.FAILED_PRECONDITION,
                       "is missing on rank(s) 1 but present on rank(s) 0, 2"),
    "absent": ({0: None, 1: None, 2: None}, grpc.StatusCode.NOT_FOUND, "not found on any rank"),
    "bad_matrix": ({}, grpc.StatusCode.INVALID_ARGUMENT, "row 2 has 2 entries"),
    "over_quota": ({}, grpc.StatusCode.RESOURCE_EXHAUSTED, "failed on rank(s) 2: storing 'y'"),
}  # fmt: skip


@pytest.mark.parametrize("case", VALIDATION)
def test_validation_fails_alike_everywhere_and_commits_nothing(case: str, seed: int) -> None:
    overrides, code, words = VALIDATION[case]
    matrix = [[1, 1, 1], [1, 1, 1], [0, 0, 3]]  # rank 2 holds 24 bytes, receives 40
    cl = Cluster(3, limits={2: 60} if case == "over_quota" else None)
    gen = torch.Generator().manual_seed(seed)
    xs: dict[int, torch.Tensor] = {}
    for r in range(3):
        override = overrides.get(r, (F32, (3, 2)))
        if override is not None:
            xs[r] = make_input(*override, gen)
    cl.put("x", xs)
    sent = [[1, 1, 1], [1, 1, 1], [0, 3]] if case == "bad_matrix" else matrix
    results = run(cl, sent, out="y")
    first = results[0]
    assert isinstance(first, CollectiveError), results
    assert first.code == code and words in first.message, first
    for res in results[1:]:
        assert type(res) is type(first) and (res.code, res.message) == (first.code, first.message)
    for r, ctx in enumerate(cl.ctxs):
        assert ctx.store.peek("y") is None
        assert (ctx.store.peek("x") is None) if r not in xs else (ctx.store.peek("x") is xs[r])
    assert all(c == Counter({EXCHANGE: 1}) for c in cl.calls), cl.calls  # decided, nothing ran


# ------------------------------------------------------------ failures
@pytest.mark.parametrize("where", ["exchange", "data collective"])
def test_a_lost_rank_breaks_the_group_everywhere_and_nothing_is_committed(
    where: str, seed: int
) -> None:
    cl = Cluster(3, data=FakeWorld(3, TIMEOUT_S))
    matrix = [[1, 1, 1], [2, 0, 1], [0, 0, 3]]
    cl.put("x", make_inputs([0, 1, 2], matrix, torch.float32, (2,), seed))
    world = cl.world if where == "exchange" else cl.data
    world.fail_next(1, RuntimeError("Connection closed by peer"))
    results = run(cl, matrix, out="y")
    assert all(isinstance(r, GroupBroken) for r in results), results
    assert "closed by peer" in str(results[1]).lower()
    assert cl.stored("y") == [None] * 3
