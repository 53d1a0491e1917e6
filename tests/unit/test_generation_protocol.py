"""The op protocol between ranks, on two real generations (real gloo groups
over a real TCPStore, real tensor stores) in one process.

What is checked here is what the protocol promises:

* the leader answers once *it* has committed, without a barrier per op; a
  follower that has not committed yet has the result's name fenced, so a read
  there waits for the commit and never returns the value from before the op;
* small operands travel inside the operand exchange (two control rounds per
  op), larger ones take a data collective and an outcome agreement; both give
  the same results, and an operand that does not fit the leader's guess falls
  back to the data collective on every rank alike;
* a result over some rank's quota fails on every rank before any data moves,
  and nothing is committed anywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from generation_pair import TIMEOUT_S, Pair
from helpers import wait_until

from collectives.errors import CollectiveError
from collectives.reduce_ops import ReduceOp
from collectives.wire.op_specs import kind_name
from collectives_server.worker.engine.handlers.tensor_ops import INLINE_MAX_BYTES


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _put(pair: Pair, name: str, parts: list[torch.Tensor]) -> None:
    for store, t in zip(pair.stores, parts, strict=True):
        store.put(name, t)


@pytest.mark.parametrize("numel", [3, INLINE_MAX_BYTES // 4 + 1])
def test_a_follower_read_right_after_the_answer_waits_for_the_follower_commit(
    pair: Pair, numel: int
) -> None:
    """Inline (small) and data-collective (large) paths alike."""
    _put(pair, "x", [torch.full((numel,), 1.0), torch.full((numel,), 2.0)])
    pair.stores[1].put("y", torch.zeros(numel))  # the value from before the op
    pair.stores[1].hold_commits = True
    pending = pair.submit("all_reduce", name="x", out="y", op=ReduceOp.SUM.wire)
    assert pair.stores[1].held.wait(TIMEOUT_S)  # the follower sits right before its commit ...
    pending.future.result(TIMEOUT_S)  # ... and the leader has answered the client
    follower = pair.stores[1]
    assert torch.equal(follower.peek("y"), torch.zeros(numel))  # not committed there yet
    assert follower.fenced() == ["y"]
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(follower.get("y")), daemon=True)
    reader.start()
    wait_until(lambda: follower.readers_waiting() == 1, 10, "the read to wait for the commit")
    assert not got  # never the value from before the op
    pair.stores[1].release.set()
    reader.join(TIMEOUT_S)
    assert torch.equal(got[0], torch.full((numel,), 3.0))
    assert follower.fenced() == []


KINDS = ["all_reduce", "reduce", "all_gather", "gather", "reduce_scatter", "all_to_all"]


@pytest.mark.parametrize("kind", [*KINDS, "broadcast"])
@pytest.mark.parametrize("numel", [4, INLINE_MAX_BYTES // 4 + 4])
def test_inline_and_data_collective_paths_give_the_same_results(
    pair: Pair, kind: str, numel: int
) -> None:
    gen = torch.Generator().manual_seed(numel)
    parts = [torch.randn(numel, generator=gen) for _ in range(2)]
    _put(pair, "v", parts)
    out = "" if kind == "broadcast" else "o"  # broadcast has no out (the SDK sends none)
    result = pair.run(kind, name="v", out=out, op=ReduceOp.MAX.wire, root=1)
    assert not isinstance(result, CollectiveError)
    reduced = torch.maximum(parts[0], parts[1])
    want = {
        "all_reduce": [reduced, reduced],
        "reduce": [None, reduced],
        "all_gather": [torch.stack(parts)] * 2,
        "gather": [None, torch.stack(parts)],
        "reduce_scatter": list(reduced.chunk(2)),
        "all_to_all": [
            torch.cat([parts[0].chunk(2)[0], parts[1].chunk(2)[0]]),
            torch.cat([parts[0].chunk(2)[1], parts[1].chunk(2)[1]]),
        ],
        "broadcast": [parts[1], parts[1]],
    }[kind]
    target = "v" if kind == "broadcast" else "o"
    for store, expected in zip(pair.stores, want, strict=True):
        if expected is None:
            assert store.peek(target) is None  # a rank other than dst stores nothing
        else:
            assert torch.equal(store.peek(target), expected), kind


@pytest.mark.parametrize(
    ("dtype", "op"),
    [
        (torch.bool, ReduceOp.SUM),
        (torch.bool, ReduceOp.PRODUCT),
        (torch.int32, ReduceOp.BXOR),
        (torch.int8, ReduceOp.SUM),
        (torch.float16, ReduceOp.AVG),
        (torch.bfloat16, ReduceOp.SUM),
        (torch.complex64, ReduceOp.PRODUCT),
        (torch.complex128, ReduceOp.AVG),
        (torch.float64, ReduceOp.MIN),
    ],
)
def test_inline_reductions_match_the_data_collective(pair: Pair, dtype, op: ReduceOp) -> None:
    """The same op on a small operand (inline) and a large one (gloo) agree element by
    element, within the rounding of half precision."""
    gen = torch.Generator().manual_seed(7)
    large = INLINE_MAX_BYTES // torch.empty((), dtype=dtype).element_size() + 8

    def make(n: int) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.randint(0, 2, (n,), generator=gen).bool()
        if not (dtype.is_floating_point or dtype.is_complex):
            return torch.randint(-50, 50, (n,), generator=gen).to(dtype)
        return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)

    parts = [make(large) for _ in range(2)]
    _put(pair, "big", parts)
    _put(pair, "small", [p[:8].clone() for p in parts])
    pair.run("all_reduce", name="big", out="big_r", op=op.wire)
    pair.run("all_reduce", name="small", out="small_r", op=op.wire)
    for store in pair.stores:
        inline, backend = store.peek("small_r"), store.peek("big_r")[:8]
        assert inline.dtype == dtype and inline.shape == (8,)
        if dtype in (torch.float16, torch.bfloat16):
            torch.testing.assert_close(inline, backend, rtol=2e-2, atol=2e-2)
        else:
            torch.testing.assert_close(inline, backend, rtol=1e-12, atol=1e-12)
    assert torch.equal(pair.stores[0].peek("small_r"), pair.stores[1].peek("small_r"))


def test_a_broadcast_src_too_large_for_the_leaders_guess_falls_back_on_every_rank(
    pair: Pair,
) -> None:
    """The leader sizes inline data from its own copy; src 1's copy is larger."""
    pair.stores[0].put("b", torch.zeros(2))
    big = torch.arange(INLINE_MAX_BYTES // 8, dtype=torch.float64)
    pair.stores[1].put("b", big)
    pair.run("broadcast", name="b", root=1)
    for store in pair.stores:
        assert torch.equal(store.peek("b"), big)
    pair.run("all_reduce", name="b", op=ReduceOp.SUM.wire)  # the group is still fine
    assert torch.equal(pair.stores[0].peek("b"), 2 * big)


@pytest.mark.parametrize("numel", [16, INLINE_MAX_BYTES // 4 + 16])
def test_over_quota_on_one_rank_fails_everywhere_before_data_moves(numel: int) -> None:
    nbytes = numel * 4
    p = Pair(limits=(None, 2 * nbytes + nbytes // 2))
    try:
        _put(p, "q", [torch.ones(numel), torch.ones(numel)])
        result = p.run("all_gather", name="q", out="g")
        assert isinstance(result, CollectiveError)
        assert result.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "failed on rank(s) 1" in result.message and "limit is" in result.message
        assert all(s.peek("g") is None for s in p.stores)  # committed nowhere
        assert p.stores[1].stats() == (1, nbytes)
        ok = p.run("all_reduce", name="q", op=ReduceOp.SUM.wire)  # fits: in place
        assert not isinstance(ok, CollectiveError)
        assert torch.equal(p.stores[1].peek("q"), torch.full((numel,), 2.0))
    finally:
        p.close()


def test_a_barrier_is_one_exchange_and_every_op_is_reported_on_both_ranks(pair: Pair) -> None:
    before = [len(d) for d in pair.done]
    result = pair.run("barrier")
    assert not isinstance(result, CollectiveError)
    assert len(pair.done[1]) == before[1] + 1
    assert [kind_name(d[-1].kind) for d in pair.done] == ["barrier", "barrier"]


def test_mismatched_operands_fail_on_every_rank_with_one_message(pair: Pair) -> None:
    _put(pair, "m", [torch.ones(3), torch.ones(4)])
    result = pair.run("all_reduce", name="m", op=ReduceOp.SUM.wire)
    assert isinstance(result, CollectiveError)
    assert result.code == grpc.StatusCode.FAILED_PRECONDITION
    assert pair.done[1][-1].tensor.name == "m"
    assert all(s.peek("m").shape in ((3,), (4,)) for s in pair.stores)  # untouched
