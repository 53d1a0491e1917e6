"""The op handlers (``worker/handlers``: every tensor collective kind, sub-groups,
validation, failures, all_reduce_gradients, new_group) on N threads over the
in-memory fake process group, without runtime or network (see ``handler_world``).
Results are checked against torch computed locally on seeded random inputs;
``world.calls`` tells which path an op took: the inline path is the operand
exchange alone, the data path the exchange, one data collective and the outcome
agreement.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import grpc
import pytest
import torch
import torch.distributed as dist
from fake_pg import FakeWorld
from handler_world import (
    EXCHANGE,
    TIMEOUT_S,
    Cluster,
    check_collective,
    inputs,
    reference,
    shape_for,
    valid,
)
from helpers import assert_tensor

from collectives.errors import CollectiveError
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.data.replaced_memory import ReplacedMemory
from collectives_server.worker.engine.handlers.model_ops import ModelOpResult
from collectives_server.worker.engine.op_context import GroupBroken, OpResult


class FailingReplacedMemory(ReplacedMemory):
    """A rank whose result allocation fails (after or before its data collective)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def empty(self, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise self.exc


# ------------------------------------------------------------ every tensor kind
SIZES = (2, 3)
AR_CASES = [
    (dtype, op)
    for dtype in (torch.float32, torch.int64, torch.bool)
    for op in ReduceOp
    if valid(op, dtype)
]


@pytest.mark.parametrize("large", [False, True], ids=["inline", "data"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("dtype", "op"), AR_CASES, ids=lambda v: str(v).split(".")[-1])
def test_all_reduce_every_op(
    dtype: torch.dtype, op: ReduceOp, size: int, large: bool, seed: int
) -> None:
    cl = Cluster(size)
    xs = inputs(list(range(size)), dtype, shape_for(dtype, large), seed)
    check_collective(cl, OpKind.ALL_REDUCE, xs, large, op=op, out="y")


KINDS = [OpKind.REDUCE, OpKind.ALL_GATHER, OpKind.GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_TO_ALL]


@pytest.mark.parametrize("out", ["", "y"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
@pytest.mark.parametrize("large", [False, True], ids=["inline", "data"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name.lower())
def test_every_kind(
    kind: OpKind, size: int, large: bool, dtype: torch.dtype, out: str, seed: int
) -> None:
    """Rooted kinds use the last rank as dst, so the leader is a non-dst rank."""
    cl = Cluster(size)
    xs = inputs(list(range(size)), dtype, shape_for(dtype, large), seed)
    op = ReduceOp.SUM if dtype.is_floating_point else ReduceOp.BXOR
    check_collective(cl, kind, xs, large, root=size - 1, op=op, out=out)


@pytest.mark.parametrize("large", [False, True], ids=["inline", "data"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast(root: str, size: int, large: bool, seed: int) -> None:
    """Every rank holds an ``x`` (receivers' old values): the src's replaces them."""
    cl = Cluster(size)
    xs = inputs(list(range(size)), torch.float32, shape_for(torch.float32, large), seed)
    check_collective(cl, OpKind.BROADCAST, xs, large, root=0 if root == "first" else size - 1)


def test_broadcast_falls_back_to_the_data_path_when_the_leaders_guess_is_too_small(
    seed: int,
) -> None:
    cl = Cluster(3)
    xs = inputs([0, 1, 2], torch.float32, (6, 3), seed)
    xs[0] = xs[0][0, :2].clone()  # the leader sizes the inline room from its 8 bytes
    check_collective(cl, OpKind.BROADCAST, xs, large=True, root=1)


@pytest.mark.parametrize("size", SIZES)
def test_barrier_inline_is_the_exchange_and_the_data_path_one_all_reduce(size: int) -> None:
    cl = Cluster(size)
    desc = worker_pb2.OpDescriptor(kind=OpKind.BARRIER, tensor=worker_pb2.TensorOpArgs())
    for announce, calls in ((True, {EXCHANGE: 1}), (False, {EXCHANGE: 2, "allreduce": 1})):
        results = cl.run(desc, announce=announce)
        assert all(isinstance(r, OpResult) and r.result_name == "" for r in results), results
        assert all(c == Counter(calls) for c in cl.calls), cl.calls
    assert all(ctx.store.stats() == (0, 0) for ctx in cl.ctxs)


# ------------------------------------------------------------ sub-groups
@pytest.mark.parametrize("large", [False, True], ids=["inline", "data"])
@pytest.mark.parametrize(
    ("kind", "ranks", "root"),
    [
        (OpKind.ALL_REDUCE, [0, 2], 0),
        (OpKind.GATHER, [0, 2], 2),
        (OpKind.ALL_TO_ALL, [0, 2], 0),
        (OpKind.ALL_REDUCE, [1, 2], 1),  # the leader is not a member: always the data path
    ],
)
def test_sub_group_and_the_non_member_stores_nothing(
    kind: OpKind, ranks: list[int], root: int, large: bool, seed: int
) -> None:
    cl = Cluster(3)
    sub = FakeWorld(2, TIMEOUT_S)
    cl.add_group(1, ranks, sub)
    xs = inputs(ranks, torch.float32, shape_for(torch.float32, large), seed)
    (outsider,) = set(range(3)) - set(ranks)
    mine = torch.randn(5, generator=torch.Generator().manual_seed(seed + 1))  # another shape
    cl.ctxs[outsider].store.put("x", mine)
    inline = large is False and 0 in ranks
    check_collective(cl, kind, xs, large=not inline, group_id=1, root=root, out="y", data=sub)
    assert cl.ctxs[outsider].store.peek("x") is mine
    assert cl.ctxs[outsider].store.peek("y") is None


# ------------------------------------------------------------ validation
VALIDATION = {
    "missing_on_one": (OpKind.ALL_REDUCE, 0, {1: None}, grpc.StatusCode.FAILED_PRECONDITION,
                       "is missing on rank(s) 1 but present on rank(s) 0, 2"),
    "absent_everywhere": (OpKind.ALL_REDUCE, 0, {0: None, 1: None, 2: None},
                          grpc.StatusCode.NOT_FOUND, "not found on any rank"),
    "shape_mismatch": (OpKind.ALL_GATHER, 0, {2: (6, 4)}, grpc.StatusCode.FAILED_PRECONDITION,
                       "disagrees across ranks"),
    "dim0_not_divisible": (OpKind.REDUCE_SCATTER, 0, {0: (4, 3), 1: (4, 3), 2: (4, 3)},
                           grpc.StatusCode.INVALID_ARGUMENT, "divisible by the group size 3"),
    "bitwise_on_float": (OpKind.ALL_REDUCE, ReduceOp.BAND.wire, {},
                         grpc.StatusCode.INVALID_ARGUMENT, "bitwise"),
    "src_missing": (OpKind.BROADCAST, 0, {0: None}, grpc.StatusCode.FAILED_PRECONDITION,
                    "missing on src rank 0"),
    "over_quota": (OpKind.ALL_GATHER, 0, {}, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   "failed on rank(s) 1: storing 'y'"),
}  # fmt: skip


@pytest.mark.parametrize("large", [False, True], ids=["inline", "data"])
@pytest.mark.parametrize("case", VALIDATION)
def test_validation_fails_alike_everywhere_and_commits_nothing(
    case: str, large: bool, seed: int
) -> None:
    kind, op, overrides, code, words = VALIDATION[case]
    shape = shape_for(torch.float32, large)
    x_bytes = shape[0] * shape[1] * 4
    cl = Cluster(3, limits={1: 2 * x_bytes} if case == "over_quota" else None)
    gen = torch.Generator().manual_seed(seed)
    xs: dict[int, torch.Tensor] = {}
    for r in range(3):
        override = overrides.get(r, shape)
        if override is not None:
            xs[r] = torch.randn(override, generator=gen)
    cl.put("x", xs)
    results = cl.tensor_op(kind, name="x", out="" if kind is OpKind.BROADCAST else "y", op=op)
    first = results[0]
    assert isinstance(first, CollectiveError), results
    assert first.code == code and words in first.message, first
    for res in results[1:]:
        assert type(res) is type(first) and (res.code, res.message) == (first.code, first.message)
    for r, ctx in enumerate(cl.ctxs):
        assert ctx.store.peek("y") is None
        x = ctx.store.peek("x")
        assert (x is None) if r not in xs else (x is xs[r])
    assert all(c == Counter({EXCHANGE: 1}) for c in cl.calls), cl.calls  # decided, nothing ran


# ------------------------------------------------------------ failures
@pytest.mark.parametrize("where", ["exchange", "data collective"])
def test_a_transport_failure_breaks_the_group_on_every_rank(where: str, seed: int) -> None:
    cl = Cluster(3, data=FakeWorld(3, TIMEOUT_S))
    xs = inputs([0, 1, 2], torch.float32, shape_for(torch.float32, True), seed)
    cl.put("x", xs)
    world = cl.world if where == "exchange" else cl.data
    world.fail_next(1, RuntimeError("Connection closed by peer"))
    results = cl.tensor_op(OpKind.ALL_REDUCE, name="x", out="y")
    assert all(isinstance(r, GroupBroken) for r in results), results
    assert "closed by peer" in str(results[1]).lower()
    assert cl.stored("y") == [None] * 3


@pytest.mark.parametrize(
    ("exc", "code", "words"),
    [
        (MemoryError(), grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory on this worker"),
        (ValueError("bad size 7"), grpc.StatusCode.INVALID_ARGUMENT, "bad size 7"),
        (RuntimeError("boom"), grpc.StatusCode.FAILED_PRECONDITION, "internal error (id "),
    ],
    ids=["memory", "value", "other"],
)
def test_a_local_failure_after_the_data_collective_fails_the_op_and_keeps_the_group(
    exc: BaseException, code: grpc.StatusCode, words: str, seed: int
) -> None:
    """reduce_scatter all-reduces, then copies out each rank's chunk: rank 1 fails there."""
    cl = Cluster(3)
    xs = inputs([0, 1, 2], torch.float32, shape_for(torch.float32, True), seed)
    cl.put("x", xs)
    cl.ctxs[1].replaced = FailingReplacedMemory(exc)
    results = cl.tensor_op(OpKind.REDUCE_SCATTER, name="x", out="y")
    first = results[0]
    assert isinstance(first, CollectiveError), results
    assert first.code == code
    assert (
        first.message.startswith("failed on rank(s) 1: reduce_scatter") and words in first.message
    )
    assert getattr(first, "ranks", None) == (1,)
    for res in results:
        assert type(res) is type(first) and (res.message, res.ranks) == (first.message, (1,))
    assert cl.stored("y") == [None] * 3
    cl.ctxs[1].replaced = ReplacedMemory()  # the group is intact: the next op succeeds
    check_collective(cl, OpKind.ALL_REDUCE, xs, large=True, out="z")


def test_a_one_sided_failure_inside_the_data_collective_breaks_the_group_everywhere(
    seed: int,
) -> None:
    """Rank 1's failure is local (ValueError) but its peers see their collective cut
    (gloo would time out): they report the group broken, and rank 1, alone in the
    agreement, times out too. No rank reports success or commits."""
    cl = Cluster(3, data=FakeWorld(3, TIMEOUT_S), timeout_s=1.0)
    xs = inputs([0, 1, 2], torch.float32, shape_for(torch.float32, True), seed)
    cl.put("x", xs)
    cl.data.fail_next(1, ValueError("invalid tensor size"))
    results = cl.tensor_op(OpKind.ALL_REDUCE, name="x", out="y")
    assert all(isinstance(r, GroupBroken) for r in results), results
    assert cl.stored("y") == [None] * 3


def test_a_local_failure_before_one_rank_issues_the_data_collective_breaks_the_group(
    seed: int,
) -> None:
    """all_reduce allocates its private buffer before the collective: if that fails on
    rank 1 only, rank 1 never joins the collective, so its peers wait for it until the
    data group's timeout. The op_failures docstring's "an allocation that fails ... the
    group stays" holds only after the collective (test above), not here."""
    cl = Cluster(3, data=FakeWorld(3, 1.0), timeout_s=1.0)
    xs = inputs([0, 1, 2], torch.float32, shape_for(torch.float32, True), seed)
    cl.put("x", xs)
    cl.ctxs[1].replaced = FailingReplacedMemory(MemoryError())
    results = cl.tensor_op(OpKind.ALL_REDUCE, name="x", out="y")
    assert all(isinstance(r, GroupBroken) for r in results), results
    assert cl.stored("y") == [None] * 3


# ------------------------------------------------------------ model op
@pytest.mark.parametrize("bias_on_rank1", [True, False])
@pytest.mark.parametrize(("op", "bucket_bytes", "buckets"), [
    (ReduceOp.SUM, 0, 1), (ReduceOp.AVG, 16, 2),
])  # fmt: skip
def test_all_reduce_gradients(
    op: ReduceOp, bucket_bytes: int, buckets: int, bias_on_rank1: bool, seed: int
) -> None:
    size = 3
    cl = Cluster(size)
    gen = torch.Generator().manual_seed(seed)
    template = torch.nn.Linear(5, 3)
    grads: list[dict[str, torch.Tensor | None]] = []
    for r, ctx in enumerate(cl.ctxs):
        module = torch.nn.Linear(5, 3)
        module.load_state_dict(template.state_dict())
        ctx.models.add("m", module, "test")
        mine: dict[str, torch.Tensor | None] = {}
        for name, p in module.named_parameters():
            mine[name] = torch.randn(p.shape, generator=gen)
            if name == "bias" and r == 1 and not bias_on_rank1:
                mine[name] = None  # contributes zeros
            p.grad = None if mine[name] is None else mine[name].clone()
        grads.append(mine)
    desc = worker_pb2.OpDescriptor(
        kind=OpKind.ALL_REDUCE_GRADIENTS,
        gradients=worker_pb2.GradientsArgs(model="m", op=op.wire, bucket_bytes=bucket_bytes),
    )
    results = cl.run(desc)
    assert all(isinstance(r, ModelOpResult) and r.buckets == buckets for r in results), results
    assert all(c["allreduce"] == buckets for c in cl.calls), cl.calls
    for name in ("weight", "bias"):
        parts = [g[name] for g in grads]
        parts = [p if p is not None else torch.zeros_like(parts[0]) for p in parts]  # type: ignore[misc]
        want = reference(op, parts)  # type: ignore[arg-type]
        for r, ctx in enumerate(cl.ctxs):
            got = dict(ctx.models.get("m").module.named_parameters())[name].grad
            assert_tensor(got, want, what=f"rank {r} {name}.grad")


def test_all_reduce_gradients_with_the_model_missing_on_one_rank_fails_everywhere() -> None:
    cl = Cluster(2)
    cl.ctxs[0].models.add("m", torch.nn.Linear(2, 2), "test")
    desc = worker_pb2.OpDescriptor(
        kind=OpKind.ALL_REDUCE_GRADIENTS, gradients=worker_pb2.GradientsArgs(model="m")
    )
    results = cl.run(desc)
    assert all(isinstance(r, CollectiveError) for r in results), results
    assert {(r.code, r.message) for r in results} == {
        (grpc.StatusCode.FAILED_PRECONDITION, results[0].message)
    }
    assert "missing on rank(s) 1" in results[0].message
    assert all(c == Counter({EXCHANGE: 1}) for c in cl.calls)


# ------------------------------------------------------------ new_group
def test_new_group_builds_gloo_groups_on_members_and_then_carries_collectives(
    seed: int,
) -> None:
    """Members build real gloo groups on a shared HashStore (``build_groups``); the
    non-member only records the membership; then all_reduce runs on the group, inline
    and over gloo. A generation at its group cap refuses the next group on every rank."""
    cl = Cluster(3, tcp_store=dist.HashStore())
    for ctx in cl.ctxs:
        ctx.max_groups = 1
    desc = worker_pb2.OpDescriptor(
        kind=OpKind.NEW_GROUP, group_id=4, new_group=worker_pb2.NewGroupArgs(ranks=[2, 0])
    )
    results = cl.run(desc)
    assert all(isinstance(r, OpResult) and r.result_ranks == [0, 2] for r in results), results
    for r, ctx in enumerate(cl.ctxs):
        entry = ctx.groups[4]
        assert entry.ranks == [0, 2]
        assert (entry.handles is None) is (r == 1)
    for large, name in ((False, "a"), (True, "b")):
        xs = inputs([0, 2], torch.float32, shape_for(torch.float32, large), seed + large)
        cl.put(name, xs)
        results = cl.tensor_op(OpKind.ALL_REDUCE, group_id=4, name=name, out=name + "_sum")
        assert all(isinstance(r, OpResult) for r in results), results
        for r in (0, 2):
            assert_tensor(cl.ctxs[r].store.peek(name + "_sum"), xs[0] + xs[2], what=f"rank {r}")
        assert cl.ctxs[1].store.peek(name + "_sum") is None
    again = worker_pb2.OpDescriptor(
        kind=OpKind.NEW_GROUP, group_id=5, new_group=worker_pb2.NewGroupArgs(ranks=[0, 1])
    )
    refused = cl.run(again)
    assert all(isinstance(r, CollectiveError) for r in refused), refused
    assert {(r.code, r.message) for r in refused} == {
        (grpc.StatusCode.RESOURCE_EXHAUSTED, refused[0].message)
    }
    assert "--max-groups 1" in refused[0].message
    assert all(5 not in ctx.groups for ctx in cl.ctxs)
