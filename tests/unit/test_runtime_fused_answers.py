"""A fused run's answers (``GenerationRuntime._step``), on two real runtimes
(``runtime_pair``): outcomes are set together when the run ends, and an op that
finished before a later one raised still gets its own result, never the error
that ended the run.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from runtime_pair import TIMEOUT_S, Pair

from collectives.errors import CollectiveError
from collectives.reduce_ops import ReduceOp

SUM = ReduceOp.SUM.wire


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(rebuild_after_s=1.0)
    yield p
    p.close()


def test_ops_that_finished_before_a_later_op_raised_keep_their_results(pair: Pair) -> None:
    gen = torch.Generator().manual_seed(21)
    names = [f"a{i}" for i in range(4)]
    parts = {n: [torch.randn(6, generator=gen) for _ in pair.stores] for n in names}
    for n in names:
        for store, t in zip(pair.stores, parts[n], strict=True):
            store.put(n, t.clone())
    leader = pair.stores[0]
    leader.hold_commits = True  # the loop stops at the first op's commit ...
    first = pair.submit("all_reduce", name="a0", op=SUM)
    assert leader.held.wait(TIMEOUT_S)
    # ... while three small ops on distinct names queue: one fused run once released.
    run = [pair.submit("all_reduce", name=n, op=SUM) for n in names[1:]]
    leader.fail_commits_of = "a2"  # the run's second op raises on the leader
    leader.hold_commits = False
    leader.release.set()
    first.future.result(TIMEOUT_S)
    answered = run[0].future.result(TIMEOUT_S)  # finished before a2 raised: its result
    assert answered.result_name == "a1"
    assert torch.equal(leader.peek("a1"), parts["a1"][0] + parts["a1"][1])
    for ticket in run[1:]:  # the op that raised and the one after it, in the same run
        error = ticket.future.exception(TIMEOUT_S)
        assert isinstance(error, CollectiveError), error
        assert error.code == grpc.StatusCode.INTERNAL
    assert torch.equal(leader.peek("a3"), parts["a3"][0])  # never ran on the leader
    # The run's error ended the epoch on the leader; both ranks rebuild the group
    # and the next op runs there.
    leader.fail_commits_of = None
    after = [torch.randn(3, generator=gen) for _ in pair.stores]
    for store, t in zip(pair.stores, after, strict=True):
        store.put("after", t.clone())
    pair.submit("all_reduce", name="after", op=SUM).future.result(TIMEOUT_S)
    assert torch.equal(leader.peek("after"), after[0] + after[1])
