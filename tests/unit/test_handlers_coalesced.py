"""The coalesced handler (``handlers/coalesced_ops``) on N threads over the fake
process group (see ``handler_world``): results against torch computed locally on
seeded random inputs, atomic failures (nothing changes anywhere), and the calls
made: one operand exchange, one data collective per bucket, one agreement.
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
import torch
from fake_pg import FakeWorld
from handler_world import EXCHANGE, TIMEOUT_S, Cluster, reference
from helpers import assert_tensor, make_input

from collectives.errors import CollectiveError
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine.handlers import coalesced_buckets
from collectives_server.worker.engine.handlers.coalesced_ops import CoalescedResult
from collectives_server.worker.engine.op_context import GroupBroken

# name -> (dtype, shape): every dtype family, 0-dim and empty tensors among them
MIXED = {
    "f32": (torch.float32, (4, 3)),
    "f64": (torch.float64, (5,)),
    "i64": (torch.int64, (2, 2, 2)),
    "b": (torch.bool, (7,)),
    "bf16": (torch.bfloat16, (3, 3)),
    "c64": (torch.complex64, (4,)),
    "f32_scalar": (torch.float32, ()),
    "i64_empty": (torch.int64, (0, 3)),
}


def _put_random(
    cl: Cluster, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], ranks: list[int], seed: int
) -> dict[str, dict[int, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xs = {name: {r: make_input(d, s, gen) for r in ranks} for name, (d, s) in specs.items()}
    for name, by_rank in xs.items():
        cl.put(name, by_rank)
    return xs


def _coalesced(
    cl: Cluster, kind: OpKind, names: list[str], group_id: int = 0, **args: object
) -> list:
    return cl.run(
        worker_pb2.OpDescriptor(
            kind=kind,
            group_id=group_id,
            coalesced=worker_pb2.CoalescedArgs(names=names, **args),  # type: ignore[arg-type]
        )
    )


def _dtypes(names: list[str]) -> int:
    return len({MIXED[n][0] for n in names})


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT], ids=["sum", "product"])
def test_all_reduce_mixed_dtypes_one_collective_per_dtype(
    size: int, op: ReduceOp, seed: int
) -> None:
    cl = Cluster(size)
    names = list(MIXED)
    xs = _put_random(cl, MIXED, list(range(size)), seed)
    results = _coalesced(cl, OpKind.ALL_REDUCE_COALESCED, names, op=op.wire)
    for r, res in enumerate(results):
        assert isinstance(res, CoalescedResult), f"rank {r}: {res!r}"
        assert res.result_names == tuple(names) and res.result_ranks == list(range(size))
        for name in names:
            want = reference(op, [xs[name][m] for m in range(size)])
            assert_tensor(cl.ctxs[r].store.peek(name), want, what=f"rank {r} {name}")
    # complex product is an all-gather and a local product, as a single all_reduce's
    gathers = 1 if op is ReduceOp.PRODUCT else 0
    moved = Counter({"allreduce": _dtypes(names) - gathers, "allgather": gathers})
    assert all(c == moved + Counter({EXCHANGE: 2}) for c in cl.calls), cl.calls


def test_buckets_split_by_size_within_each_dtype(monkeypatch, seed: int) -> None:
    """200 small tensors of 2 dtypes, interleaved, with 4 KiB buckets: exactly one
    all-reduce per (dtype, bucket), never one per name."""
    monkeypatch.setattr(coalesced_buckets, "BUCKET_BYTES", 4096)
    specs = {f"t{i}": (torch.float32 if i % 2 else torch.int64, (64 + i % 5,)) for i in range(200)}
    cl = Cluster(2)
    xs = _put_random(cl, specs, [0, 1], seed)
    names = list(specs)
    results = _coalesced(cl, OpKind.ALL_REDUCE_COALESCED, names, op=ReduceOp.MAX.wire)
    assert all(isinstance(r, CoalescedResult) for r in results), results
    plans = [coalesced_buckets.Plan(d, s) for d, s in specs.values()]
    expected = len(coalesced_buckets.buckets(plans, by_dtype=True))
    float_bytes = sum(4 * s[0] for d, s in specs.values() if d == torch.float32)
    assert expected >= 2 * 2 and expected >= float_bytes // 4096
    assert all(c == Counter({EXCHANGE: 2, "allreduce": expected}) for c in cl.calls), cl.calls
    for name in names:
        want = reference(ReduceOp.MAX, [xs[name][0], xs[name][1]])
        for r in (0, 1):
            assert_tensor(cl.ctxs[r].store.peek(name), want, what=f"rank {r} {name}")


@pytest.mark.parametrize("src", [0, 2])
def test_broadcast_moves_every_dtype_in_one_collective(src: int, seed: int) -> None:
    cl = Cluster(3)
    names = list(MIXED)
    xs = _put_random(cl, MIXED, [src], seed)
    results = _coalesced(cl, OpKind.BROADCAST_COALESCED, names, root=src)
    for r, res in enumerate(results):
        assert isinstance(res, CoalescedResult), f"rank {r}: {res!r}"
        assert res.result_names == tuple(names)
        for name in names:
            got = cl.ctxs[r].store.peek(name)
            assert_tensor(got, xs[name][src], what=f"rank {r} {name}")
            if r == src:
                assert got is xs[name][src], "the src keeps its own tensor"
    assert all(c == Counter({EXCHANGE: 2, "broadcast": 1}) for c in cl.calls), cl.calls


@pytest.mark.parametrize("outs", [False, True], ids=["in-place", "outs"])
def test_all_gather_stacks_each_name(outs: bool, seed: int) -> None:
    cl = Cluster(3)
    names = list(MIXED)
    targets = [f"out/{n}" for n in names] if outs else names
    xs = _put_random(cl, MIXED, [0, 1, 2], seed)
    results = _coalesced(cl, OpKind.ALL_GATHER_COALESCED, names, outs=targets if outs else [])
    for r, res in enumerate(results):
        assert isinstance(res, CoalescedResult), f"rank {r}: {res!r}"
        assert res.result_names == tuple(targets)
        for name, target in zip(names, targets, strict=True):
            want = torch.stack([xs[name][m] for m in range(3)])
            assert_tensor(cl.ctxs[r].store.peek(target), want, what=f"rank {r} {target}")
            if outs:
                assert cl.ctxs[r].store.peek(name) is xs[name][r], "the input is kept"
    assert all(c == Counter({EXCHANGE: 2, "allgather": 1}) for c in cl.calls), cl.calls


def test_a_sub_group_and_its_non_member(seed: int) -> None:
    cl = Cluster(3)
    cl.add_group(1, [0, 2], FakeWorld(2, TIMEOUT_S))
    xs = _put_random(cl, {"a": MIXED["f32"], "b": MIXED["i64"]}, [0, 2], seed)
    results = _coalesced(cl, OpKind.ALL_REDUCE_COALESCED, ["a", "b"], group_id=1)
    assert all(isinstance(r, CoalescedResult) for r in results), results
    for name in ("a", "b"):
        want = reference(ReduceOp.SUM, [xs[name][0], xs[name][2]])
        for r in (0, 2):
            assert_tensor(cl.ctxs[r].store.peek(name), want, what=f"rank {r} {name}")
        assert cl.ctxs[1].store.peek(name) is None


# ------------------------------------------------------------ atomic failures
FAILURES = {
    # case: (names, what to do to rank 1's "b", op, code, words)
    "missing_on_one_rank": (["a", "b"], "delete", ReduceOp.SUM,
                            grpc.StatusCode.FAILED_PRECONDITION, "'b' is missing on rank(s) 1"),
    "absent_everywhere": (["a", "zz"], None, ReduceOp.SUM, grpc.StatusCode.NOT_FOUND,
                          "'zz' not found on any rank"),
    "shape_mismatch": (["a", "b"], "reshape", ReduceOp.SUM,
                       grpc.StatusCode.FAILED_PRECONDITION, "'b' disagrees across ranks"),
    "bitwise_on_float": (["b", "a"], None, ReduceOp.BAND, grpc.StatusCode.INVALID_ARGUMENT,
                         "all_reduce of 'a'"),
}  # fmt: skip


@pytest.mark.parametrize("case", FAILURES)
def test_a_failing_name_fails_the_whole_op_and_changes_nothing(case: str, seed: int) -> None:
    names, tamper, op, code, words = FAILURES[case]
    cl = Cluster(3)
    xs = _put_random(cl, {"a": (torch.float32, (3, 2)), "b": (torch.int64, (4,))}, [0, 1, 2], seed)
    if tamper == "delete":
        cl.ctxs[1].store.delete("b")
    elif tamper == "reshape":
        cl.ctxs[1].store.put("b", torch.zeros(5, dtype=torch.int64))
    before = [{n: ctx.store.peek(n) for n in ("a", "b")} for ctx in cl.ctxs]
    results = _coalesced(cl, OpKind.ALL_REDUCE_COALESCED, names, op=op.wire)
    first = results[0]
    assert isinstance(first, CollectiveError) and first.code == code, results
    assert words in first.message, first.message
    assert all((r.code, r.message) == (first.code, first.message) for r in results)
    for r, ctx in enumerate(cl.ctxs):
        for n in ("a", "b"):
            assert ctx.store.peek(n) is before[r][n], f"rank {r}: {n} changed"
    assert xs["a"][0] is before[0]["a"]
    assert all(c == Counter({EXCHANGE: 1}) for c in cl.calls), cl.calls  # no data moved


def test_quota_is_judged_for_the_whole_op(seed: int) -> None:
    """Each result would fit rank 1's store alone; together they do not."""
    cl = Cluster(2, limits={1: 3 * 4096})
    _put_random(cl, {"a": (torch.float32, (1024,)), "b": (torch.float32, (1024,))}, [0, 1], seed)
    results = _coalesced(
        cl, OpKind.ALL_GATHER_COALESCED, ["a", "b"], outs=["out/a", "out/b"]
    )  # 2 x 8 KiB more on a store holding 8 KiB, limit 12 KiB
    first = results[0]
    assert isinstance(first, CollectiveError), results
    assert first.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "rank(s) 1" in first.message
    assert all(ctx.store.peek("out/a") is None for ctx in cl.ctxs)


def test_a_lost_rank_fails_the_op_everywhere_with_nothing_committed(seed: int) -> None:
    cl = Cluster(3, data=FakeWorld(3, TIMEOUT_S))
    xs = _put_random(cl, {"a": MIXED["f32"], "b": MIXED["f64"]}, [0, 1, 2], seed)
    cl.data.fail_next(2, RuntimeError("Connection closed by peer"))
    results = _coalesced(cl, OpKind.ALL_REDUCE_COALESCED, ["a", "b"])
    assert all(isinstance(r, GroupBroken) for r in results), results
    for r, ctx in enumerate(cl.ctxs):
        assert ctx.store.peek("a") is xs["a"][r] and ctx.store.peek("b") is xs["b"][r]
    assert cl.ctxs[1].store.fenced() == []
