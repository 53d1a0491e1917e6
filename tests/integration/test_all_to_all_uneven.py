"""all_to_all with ``split_sizes`` (uneven) on real local clusters of 2 and 3
workers, sub-groups and async handles included.

``split_sizes[i][j]`` rows of dim 0 go from member i to member j; member j
stores ``torch.cat([chunk i->j for every member i])``. Each test puts fresh
random tensors on every rank, runs the op through the SDK and compares every
rank's stored result with what torch computes locally on the same inputs
(:func:`oracle`), exactly. Every refusal is checked for its gRPC code, on every
path that can raise it (the SDK, the leader's servicer over raw gRPC, the
workers' cross-rank validation), and for committing nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
import pytest
import torch
from collective_cases import TIMEOUT_S, dtype_id
from helpers import assert_tensor, get_each, make_input, put_each
from raw_grpc import Env, opts

import collectives
from collectives.v1 import worker_pb2

Matrix = list[list[int]]
DTYPES = (torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.complex64)
ROW = (3, 2)  # the dims after dim 0


def oracle(inputs: Sequence[torch.Tensor], matrix: Matrix, j: int) -> torch.Tensor:
    """What member j stores: torch.cat of chunk i->j for every member i, in order."""
    return torch.cat([torch.split(x, matrix[i])[j] for i, x in enumerate(inputs)], 0)


def random_matrix(n: int, gen: torch.Generator, high: int = 4) -> Matrix:
    m = torch.randint(0, high, (n, n), generator=gen).tolist()
    m[0][n - 1] = 0  # at least one zero-row chunk
    m[n - 1][0] = max(m[n - 1][0], 1)  # and some data moves
    return m


def make_inputs(matrix: Matrix, dtype: torch.dtype, gen: torch.Generator, row=ROW):
    return [make_input(dtype, (sum(r), *row), gen) for r in matrix]


def check_results(
    cluster, name: str, out: str | None, inputs, matrix: Matrix, ranks: Sequence[int]
) -> None:
    """Member ranks[j] stores oracle(j) under out (or name); with out, inputs unchanged."""
    for j, rank in enumerate(ranks):
        got = cluster.get(out or name, rank=rank)
        assert_tensor(got, oracle(inputs, matrix, j), what=f"member {j} (rank {rank})")
        if out:
            assert_tensor(cluster.get(name, rank=rank), inputs[j], what=f"input on rank {rank}")


def assert_nothing_committed(cluster, name: str, out: str, inputs) -> None:
    for rank in range(cluster.world_size):
        with pytest.raises(collectives.NotFound):
            cluster.get(out, rank=rank)
        if inputs[rank] is not None:
            assert_tensor(cluster.get(name, rank=rank), inputs[rank], what=f"rank {rank}")


# ------------------------------------------------------------------ results


@pytest.mark.parametrize("use_out", [False, True], ids=["in-place", "out"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_every_member_gets_its_column_in_member_order(cluster, gen, uname, dtype, use_out):
    name, out = uname("in"), (uname("out") if use_out else None)
    matrix = random_matrix(cluster.world_size, gen)
    inputs = make_inputs(matrix, dtype, gen)
    put_each(cluster, name, inputs)

    assert cluster.all_to_all(name, out=out, split_sizes=matrix, timeout=TIMEOUT_S) is None

    check_results(cluster, name, out, inputs, matrix, range(cluster.world_size))


def test_the_issue_example_and_a_rank_that_receives_nothing(cluster2, gen, uname):
    """[[2, 1], [0, 3]]: rank 0 gets 2 rows, rank 1 gets 4; then [[0, 0], [3, 0]]:
    rank 0 sends nothing (dim 0 == 0) and rank 1 receives nothing (stores dim 0 == 0)."""
    for matrix in ([[2, 1], [0, 3]], [[0, 0], [3, 0]]):
        name = uname()
        inputs = make_inputs(matrix, torch.float32, gen)
        put_each(cluster2, name, inputs)
        cluster2.all_to_all(name, out=None, split_sizes=matrix, timeout=TIMEOUT_S)
        check_results(cluster2, name, None, inputs, matrix, [0, 1])
    assert cluster2.get(name, rank=1).shape == (0, *ROW)


def test_nothing_to_move_at_all(cluster, uname):
    n = cluster.world_size
    name, out = uname("in"), uname("out")
    matrix = [[0] * n for _ in range(n)]
    inputs = [torch.empty((0, 5), dtype=torch.int64) for _ in range(n)]
    put_each(cluster, name, inputs)
    cluster.all_to_all(name, out=out, split_sizes=matrix, timeout=TIMEOUT_S)
    for rank, got in enumerate(get_each(cluster, out)):
        assert_tensor(got, inputs[rank], what=f"rank {rank}")


def test_several_mebibytes_and_the_even_split_alongside(cluster3, gen, uname):
    """Rows of 4 KiB, about 3 MiB per rank; then an even all_to_all on the same inputs."""
    name, out = uname("in"), uname("out")
    matrix = [[200, 0, 600], [1, 1, 1], [300, 250, 50]]
    inputs = make_inputs(matrix, torch.float32, gen, row=(1024,))
    put_each(cluster3, name, inputs)
    cluster3.all_to_all(name, out=out, split_sizes=matrix, timeout=TIMEOUT_S)
    check_results(cluster3, name, out, inputs, matrix, [0, 1, 2])
    even = uname("even")
    xs = [make_input(torch.float32, (6, 2), gen) for _ in range(3)]
    put_each(cluster3, even, xs)
    cluster3.all_to_all(even, timeout=TIMEOUT_S)
    check_results(cluster3, even, None, xs, [[2, 2, 2]] * 3, [0, 1, 2])


@pytest.mark.parametrize("members", [[0, 2], [1, 2]], ids=["g02", "g12"])
def test_a_sub_group_uses_group_local_indices(cluster3, gen, uname, members):
    name, out = uname("in"), uname("out")
    matrix = [[1, 3], [2, 0]]  # member order: members[0], members[1]
    inputs = make_inputs(matrix, torch.int64, gen)
    (outsider,) = set(range(3)) - set(members)
    for x, rank in zip(inputs, members, strict=True):
        cluster3.put(name, x, rank=rank)
    theirs = make_input(torch.float32, (7,), gen)
    cluster3.put(name, theirs, rank=outsider)
    group = cluster3.new_group(members)

    cluster3.all_to_all(name, out=out, group=group, split_sizes=matrix, timeout=TIMEOUT_S)

    check_results(cluster3, name, out, inputs, matrix, members)
    assert_tensor(cluster3.get(name, rank=outsider), theirs, what="the outsider's input")
    with pytest.raises(collectives.NotFound):
        cluster3.get(out, rank=outsider)


def test_async_op(cluster, gen, uname):
    names = [uname(f"a{k}") for k in range(3)]
    cases = []
    for name in names:
        matrix = random_matrix(cluster.world_size, gen)
        inputs = make_inputs(matrix, torch.bfloat16, gen)
        put_each(cluster, name, inputs)
        cases.append((name, matrix, inputs))
    works = [cluster.all_to_all(n, split_sizes=m, async_op=True) for n, m, _ in cases]
    for work in works:
        assert isinstance(work, collectives.Work)
        assert work.result(timeout=TIMEOUT_S) is None and work.exception() is None
    for name, matrix, inputs in cases:
        check_results(cluster, name, None, inputs, matrix, range(cluster.world_size))


# ------------------------------------------------------------------ refusals

BAD_MATRICES = {
    "not-square": [[1, 1, 1], [1, 1, 1], [1, 1]],
    "wrong-size": [[1, 1], [1, 1]],
    "negative": [[1, 1, 1], [1, -1, 2], [1, 1, 1]],
    "not-int": [[1, 1, 1], [1, 1.0, 1], [1, 1, 1]],
}


@pytest.mark.parametrize("case", BAD_MATRICES)
def test_a_bad_matrix_is_invalid_argument_in_the_sdk(cluster3, gen, uname, case):
    name = uname()
    inputs = [make_input(torch.float32, (3, 2), gen) for _ in range(3)]
    put_each(cluster3, name, inputs)
    with pytest.raises(collectives.InvalidArgument) as info:
        cluster3.all_to_all(name, out=uname("o"), split_sizes=BAD_MATRICES[case], async_op=True)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "split_sizes" in info.value.message


@pytest.fixture(scope="module")
def raw(cluster2_address: str, cluster2) -> Iterator[Env]:
    e = Env(cluster2_address)
    yield e
    e.close()


@pytest.mark.parametrize(
    ("flat", "words"),
    [
        ([1, 1, 1], "row 1 has 1 entries"),
        ([1, 1, 1, 1, 1], "got 3 rows"),
        ([2, -1, 0, 0], "split_sizes[0][1] is -1"),
    ],
    ids=["short", "long", "negative"],
)
def test_the_servicer_checks_the_matrix_with_the_same_words(raw, flat, words):
    name = raw.name()
    raw.put_all(name, [torch.ones(2, 2), torch.ones(2, 2)])
    request = worker_pb2.AllToAllRequest(options=opts(), name=name, out="", split_sizes=flat)
    with pytest.raises(grpc.RpcError) as info:
        raw.leader.AllToAll(request, timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


def test_the_reply_describes_the_leaders_result(raw):
    name = raw.name()
    raw.put_all(name, [torch.arange(6.0).reshape(3, 2), torch.arange(4.0).reshape(2, 2)])
    request = worker_pb2.AllToAllRequest(
        options=opts(), name=name, out=name + "o", split_sizes=[1, 2, 0, 2]
    )
    reply = raw.leader.AllToAll(request, timeout=TIMEOUT_S)
    assert (reply.result_name, list(reply.result_ranks), list(reply.shape)) == (
        name + "o",
        [0, 1],
        [1, 2],
    )
    assert raw.get_raw(name + "o", rank=1).shape == (4, 2)


WORKER_REFUSALS = {
    # rank -> (dtype, shape) or None (absent); the matrix is [[1, 1, 1]] * 3
    "row-sum": ({1: (torch.float32, (4, 2))}, collectives.InvalidArgument,
                "rank 1 (member 1) has 4 rows in dim 0 but its row of split_sizes sums to 3"),
    "dims-after-0": ({2: (torch.float32, (3, 5))}, collectives.FailedPrecondition,
                     "same dims after dim 0"),
    "dtype": ({0: (torch.int64, (3, 2))}, collectives.FailedPrecondition, "rank 0: int64[3, 2]"),
    "0-dim": ({1: (torch.float32, ())}, collectives.InvalidArgument, "0-dim on rank(s) 1"),
    "missing-on-one": ({2: None}, collectives.FailedPrecondition, "is missing on rank(s) 2"),
    "absent": ({0: None, 1: None, 2: None}, collectives.NotFound, "not found on any rank"),
}  # fmt: skip


@pytest.mark.parametrize("case", WORKER_REFUSALS)
def test_the_workers_refuse_together_and_commit_nothing(cluster3, gen, uname, case):
    overrides, error, words = WORKER_REFUSALS[case]
    name, out = uname("in"), uname("out")
    inputs = []
    for rank in range(3):
        spec = overrides.get(rank, (torch.float32, (3, 2)))
        inputs.append(None if spec is None else make_input(*spec, gen))
        if inputs[rank] is not None:
            cluster3.put(name, inputs[rank], rank=rank)

    with pytest.raises(error) as info:
        cluster3.all_to_all(name, out=out, split_sizes=[[1, 1, 1]] * 3, timeout=TIMEOUT_S)

    assert info.value.code == error.default_code
    assert words in info.value.message, info.value.message
    assert "all_to_all_uneven" in info.value.message
    assert_nothing_committed(cluster3, name, out, inputs)
