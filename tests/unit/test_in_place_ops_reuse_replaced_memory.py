"""In-place ops keep exactly the memory they replaced (``worker/replaced_memory.py``).

The handlers drop their operand reference before the commit, so the value a
result replaces has no other reference and its memory serves the next result.
"""

from __future__ import annotations

import torch
from handler_world import Cluster

from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine.op_context import OpResult

MiB = 1 << 20


def test_an_in_place_all_reduce_reuses_the_value_it_replaces(seed: int) -> None:
    """The handler drops its operand reference before the commit, so a large in-place
    all_reduce gets its next result buffer from the value it replaced instead of
    fresh pages (the operand had stayed referenced, and every op paid the faults)."""
    size = 2
    cl = Cluster(size)
    gen = torch.Generator().manual_seed(seed)
    values = {r: torch.randn(MiB // 2, generator=gen) for r in range(size)}  # 2 MiB
    cl.put("x", {r: v.clone() for r, v in values.items()})
    expected = values[0] + values[1]
    for step in range(4):
        results = cl.tensor_op(OpKind.ALL_REDUCE, name="x")
        assert all(isinstance(r, OpResult) for r in results), results
        for rank, ctx in enumerate(cl.ctxs):
            torch.testing.assert_close(ctx.store.peek("x"), expected)
            assert len(ctx.replaced) == 1, f"rank {rank}, op {step}: replaced value not kept"
        expected = expected * 2


def test_an_in_place_coalesced_all_reduce_reuses_the_values_it_replaces(seed: int) -> None:
    size, names = 2, ["a", "b"]
    cl = Cluster(size)
    gen = torch.Generator().manual_seed(seed)
    values = {n: {r: torch.randn(MiB // 2, generator=gen) for r in range(size)} for n in names}
    for n in names:
        cl.put(n, {r: v.clone() for r, v in values[n].items()})
    expected = {n: values[n][0] + values[n][1] for n in names}
    desc = worker_pb2.OpDescriptor(
        kind=OpKind.ALL_REDUCE_COALESCED, coalesced=worker_pb2.CoalescedArgs(names=names)
    )
    for step in range(3):
        results = cl.run(desc)
        assert all(isinstance(r, OpResult) for r in results), results
        for rank, ctx in enumerate(cl.ctxs):
            for n in names:
                torch.testing.assert_close(ctx.store.peek(n), expected[n])
            assert len(ctx.replaced) == 2, f"rank {rank}, op {step}: replaced values not kept"
        expected = {n: v * 2 for n, v in expected.items()}
