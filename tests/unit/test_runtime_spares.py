"""Reusing the memory of replaced results (``collective_ops.Spares``).

A replaced value's memory is reused for the next result of the same size only
when nothing else can still see it; anything that can (another reference, a
view, a detached alias) keeps its bytes.
"""

from __future__ import annotations

import torch
from handler_world import Cluster

from collectives.op_specs import OpKind
from collectives.v1 import worker_pb2
from collectives_server.worker.collective_ops import Spares, copy_into, private_copy
from collectives_server.worker.op_context import OpResult
from collectives_server.worker.store import TensorStore

MiB = 1 << 20
CPU = torch.device("cpu")


def _big(value: float = 1.0) -> torch.Tensor:
    return torch.full((MiB // 2,), value)  # 2 MiB of float32


def _replace(store: TensorStore, spares: Spares, value: float) -> bool:
    """What the executor does at a commit: replace, offer the old value, drop it."""
    old = store.replace("y", _big(value))
    return old is not None and spares.offer(old)


def test_an_exclusive_replaced_value_is_reused_for_the_next_result() -> None:
    store, spares = TensorStore(CPU), Spares()
    store.put("y", _big(1.0))
    assert _replace(store, spares, 2.0)
    assert len(spares) == 1
    x = torch.arange(MiB // 2, dtype=torch.float32)
    out = private_copy(x, spares.empty)
    assert torch.equal(out, x) and len(spares) == 0
    assert out._base is None and out.is_contiguous()


def test_a_value_still_seen_elsewhere_is_never_reused() -> None:
    store, spares = TensorStore(CPU), Spares()
    for hold in ("same", "view", "detach", "storage-tensor"):
        store.put("y", _big(5.0))
        current = store.get("y")
        if hold == "same":
            holder = current
        elif hold == "view":
            holder = current[10:]
        elif hold == "detach":
            holder = current.detach()
        else:
            holder = torch.empty(0).set_(current.untyped_storage(), 0, (4,))
        del current
        assert not _replace(store, spares, 6.0), hold
        assert len(spares) == 0
        # The holder still sees the old bytes after the next results are made.
        for _ in range(2):
            private_copy(_big(9.0), spares.empty)
        assert float(holder.reshape(-1)[0]) == 5.0, hold
        del holder


def test_limits_and_clear() -> None:
    spares = Spares(max_buffers=2)
    for value in range(3):
        t = _big(float(value))
        assert spares.offer(t)  # our one reference, t, is dropped next
        del t
    assert len(spares) == 2
    small = torch.ones(16)
    assert not spares.offer(small)  # small: the heap is cheap already
    odd = spares.empty((3,), torch.float32, CPU)  # no kept buffer of that size
    assert odd.shape == (3,) and len(spares) == 2
    spares.clear()
    assert len(spares) == 0


def test_a_reused_buffer_takes_any_dtype_and_shape_of_the_same_size() -> None:
    spares = Spares()
    t = _big()
    assert spares.offer(t)
    del t
    out = spares.empty((MiB // 8, 2), torch.float64, CPU)
    assert out.shape == (MiB // 8, 2) and out.dtype == torch.float64 and len(spares) == 0
    src = torch.randn(MiB // 8, 2, dtype=torch.float64)
    copy_into(out, src)
    assert torch.equal(out, src)


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
            assert len(ctx.spares) == 1, f"rank {rank}, op {step}: replaced value not kept"
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
            assert len(ctx.spares) == 2, f"rank {rank}, op {step}: replaced values not kept"
        expected = {n: v * 2 for n, v in expected.items()}
