"""The engine's invariant, ``OpContext.agree_and_commit``: every rank returns the same
outcome, and a rank stores its results only once every rank agreed the op succeeded."""

from __future__ import annotations

import grpc
import torch
from fake_pg import run_ranks
from handler_world import RUN_TIMEOUT_S, Cluster

from collectives.errors import CollectiveError

MiB = 1 << 20


def test_results_are_committed_on_every_rank_once_all_succeeded() -> None:
    cl = Cluster(3)
    old = {r: torch.full((MiB // 2,), float(r)) for r in range(3)}  # 2 MiB: worth keeping
    cl.put("x", old)
    del old  # the store holds the only references: replaced, they can be kept
    new = {r: torch.full((MiB // 2,), 10.0 + r) for r in range(3)}

    def body(rank: int, _pg: object) -> CollectiveError | None:
        results = {"x": new[rank], "y": torch.tensor([rank]), "absent": None}
        return cl.ctxs[rank].agree_and_commit(grpc.StatusCode.OK, "", results)

    assert run_ranks(cl.world, body, RUN_TIMEOUT_S) == [None, None, None]
    for rank, ctx in enumerate(cl.ctxs):
        assert ctx.store.peek("x") is new[rank]
        assert torch.equal(ctx.store.peek("y"), torch.tensor([rank]))
        assert ctx.store.peek("absent") is None
        assert len(ctx.replaced) == 1, f"rank {rank}: the replaced value was not kept"


def test_one_failed_rank_fails_every_rank_alike_and_nothing_is_committed() -> None:
    cl = Cluster(3)
    cl.put("x", {r: torch.tensor([float(r)]) for r in range(3)})

    def body(rank: int, _pg: object) -> CollectiveError | None:
        code, message = grpc.StatusCode.OK, ""
        if rank == 1:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory here"
        result = torch.tensor([99.0])
        return cl.ctxs[rank].agree_and_commit(code, message, {"x": result, "z": result})

    errors = run_ranks(cl.world, body, RUN_TIMEOUT_S)
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert {(e.code, e.message, e.ranks) for e in errors} == {
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "failed on rank(s) 1: out of memory here", (1,))
    }
    for rank, ctx in enumerate(cl.ctxs):
        assert torch.equal(ctx.store.peek("x"), torch.tensor([float(rank)]))
        assert ctx.store.peek("z") is None
