"""Running the worker's op handlers on N threads over ``tests/fake_pg.py``, for
``test_handlers*.py``: one :class:`OpContext` per rank, the generation loop's part played
by the test (the leader's inline capacity computed on rank 0 before the threads
start, the same ``Announcement`` for every rank), and torch oracles that fold in
rank order as the fake does, so results compare exactly.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from fake_pg import FakeWorld, run_ranks
from helpers import assert_tensor, make_input

from collectives.errors import CollectiveError
from collectives.reduce_ops import ReduceOp, check_op_for_dtype
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind, spec
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.engine.handlers import handler_for
from collectives_server.worker.engine.handlers.tensor_ops import INLINE_MAX_BYTES, inline_capacity
from collectives_server.worker.engine.op_context import (
    Announcement,
    GroupEntry,
    OpContext,
    OpResult,
)
from collectives_server.worker.engine.process_groups import GroupHandles, NcclFactory
from collectives_server.worker.models.registry import ModelRegistry

TIMEOUT_S = 5.0
RUN_TIMEOUT_S = 30.0
CPU = torch.device("cpu")
EXCHANGE = "_allgather_base"  # operand exchange and outcome agreement (control)
DATA_CALL = {
    OpKind.BROADCAST: "broadcast",
    OpKind.ALL_REDUCE: "allreduce",
    OpKind.REDUCE: "allreduce",
    OpKind.ALL_GATHER: "allgather",
    OpKind.GATHER: "gather",
    OpKind.REDUCE_SCATTER: "allreduce",
    OpKind.ALL_TO_ALL: "alltoall_base",
    OpKind.BARRIER: "allreduce",
}
_FOLD = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}
_BOOL_FOLD = {  # as NCCL: sum is logical or, product logical and
    **{op: torch.logical_or for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR)},
    **{op: torch.logical_and for op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND)},
    ReduceOp.BXOR: torch.logical_xor,
}


def valid(op: ReduceOp, dtype: torch.dtype) -> bool:
    try:
        check_op_for_dtype(op, dtype)
    except CollectiveError:
        return False
    return True


def shape_for(dtype: torch.dtype, large: bool) -> tuple[int, int]:
    """(6, k): dim 0 divides by 2 and 3; large: over INLINE_MAX_BYTES (the data path)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (6, INLINE_MAX_BYTES // (6 * itemsize) + 1) if large else (6, 3)


def reference(op: ReduceOp, parts: list[torch.Tensor]) -> torch.Tensor:
    fold = _BOOL_FOLD if parts[0].dtype == torch.bool else _FOLD
    acc = functools.reduce(fold[op], parts)
    return acc / len(parts) if op is ReduceOp.AVG else acc


def expected(
    kind: OpKind,
    xs: dict[int, torch.Tensor],
    members: list[int],
    rank: int,
    root: int,
    op: ReduceOp,
) -> torch.Tensor | None:
    """What ``rank`` stores at the op's target (None: nothing)."""
    if rank not in members or not spec(kind).stores_on(rank, root):
        return None
    parts, n, i = [xs[m] for m in members], len(members), members.index(rank)
    return {
        OpKind.BROADCAST: lambda: xs[root],
        OpKind.ALL_REDUCE: lambda: reference(op, parts),
        OpKind.REDUCE: lambda: reference(op, parts),
        OpKind.ALL_GATHER: lambda: torch.stack(parts),
        OpKind.GATHER: lambda: torch.stack(parts),
        OpKind.REDUCE_SCATTER: lambda: reference(op, parts).chunk(n)[i],
        OpKind.ALL_TO_ALL: lambda: torch.cat([p.chunk(n)[i] for p in parts]),
    }[kind]()


class Cluster:
    """N ranks' contexts over one fake world (control; also data unless ``data`` is given)."""

    def __init__(
        self,
        size: int,
        data: FakeWorld | None = None,
        timeout_s: float = TIMEOUT_S,
        limits: dict[int, int] | None = None,
        tcp_store: dist.Store | None = None,
        nccl: NcclFactory | None = None,
    ) -> None:
        self.world = FakeWorld(size, timeout_s)
        self.data = data or self.world
        self._nccl = nccl  # what makes the sub-groups of an NCCL-like ``data``
        limits = limits or {}
        self.ctxs = [
            OpContext(
                generation=1,
                rank=r,
                world_size=size,
                device=CPU,
                host=None,
                timeout_s=timeout_s,
                tcp_store=tcp_store,  # type: ignore[arg-type]  # only new_group reads it
                prefix="g1",
                store=TensorStore(CPU, limits.get(r)),
                models=ModelRegistry([CPU]),
                groups={0: GroupEntry(0, list(range(size)), self._handles(r, self.data))},
                control=self.world.pg(r),
            )
            for r in range(size)
        ]
        self._op_id = 0
        self.calls: list[Counter[str]] = []  # control world calls of the last op, per rank

    def _handles(self, rank: int, data: FakeWorld) -> GroupHandles:
        return GroupHandles(control=self.world.pg(rank), data=data.pg(rank), nccl=self._nccl)  # type: ignore[arg-type]

    def add_group(self, group_id: int, ranks: list[int], data: FakeWorld) -> None:
        for r, ctx in enumerate(self.ctxs):
            handles = None
            if r in ranks:
                pg = data.pg(ranks.index(r))
                handles = GroupHandles(control=pg, data=pg)  # type: ignore[arg-type]
            ctx.groups[group_id] = GroupEntry(group_id, ranks, handles)

    def put(self, name: str, tensors: dict[int, torch.Tensor]) -> None:
        for r, t in tensors.items():
            self.ctxs[r].store.put(name, t)

    def stored(self, name: str) -> list[torch.Tensor | None]:
        return [ctx.store.peek(name) for ctx in self.ctxs]

    def run(self, desc: worker_pb2.OpDescriptor, announce: bool = True) -> list[Any]:
        """Runs ``desc`` on every rank as the runtime would; each rank's result or error."""
        self._op_id += 1
        desc.op_id, desc.generation = self._op_id, 1
        inline = inline_capacity(self.ctxs[0], desc) if announce else None
        before = [c.copy() for c in self.world.calls]

        def body(rank: int, _pg: Any) -> Any:
            mine = worker_pb2.OpDescriptor()
            mine.CopyFrom(desc)  # as a follower receives it
            return handler_for(mine.kind)(self.ctxs[rank], mine, Announcement(inline))

        results = run_ranks(self.world, body, RUN_TIMEOUT_S)
        self.calls = [c - b for c, b in zip(self.world.calls, before, strict=True)]
        return results

    def tensor_op(self, kind: OpKind, group_id: int = 0, **args: Any) -> list[Any]:
        return self.run(
            worker_pb2.OpDescriptor(
                kind=kind, group_id=group_id, tensor=worker_pb2.TensorOpArgs(**args)
            )
        )


def inputs(
    ranks: list[int], dtype: torch.dtype, shape: tuple[int, ...], seed: int
) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {r: make_input(dtype, shape, gen) for r in ranks}


def check_collective(
    cl: Cluster,
    kind: OpKind,
    xs: dict[int, torch.Tensor],
    large: bool,
    group_id: int = 0,
    root: int = 0,
    op: ReduceOp = ReduceOp.SUM,
    out: str = "",
    data: FakeWorld | None = None,
) -> None:
    """Runs ``kind`` on ``xs`` and checks every rank's reply, store and calls (``data``:
    the group's data world when it is not the cluster's)."""
    members = cl.ctxs[0].groups[group_id].ranks
    data = data or cl.data
    before = {r: x.clone() for r, x in xs.items()}
    cl.put("x", xs)
    data_before = [c.copy() for c in data.calls]
    results = cl.tensor_op(kind, group_id, name="x", out=out, op=op.wire, root=root)
    data_calls = [c - b for c, b in zip(data.calls, data_before, strict=True)]
    target, s = out or "x", spec(kind)
    for r, res in enumerate(results):
        assert isinstance(res, OpResult), f"rank {r}: {res!r}"
        assert res.result_ranks == s.result_ranks(members, root)
        assert res.result_name == ("x" if kind is OpKind.BROADCAST else target)
        source = xs[root] if kind is OpKind.BROADCAST else xs[members[0]]
        assert res.shape == s.result_shape(source.shape, len(members))
        want = expected(kind, xs, members, r, root, op)
        got = cl.ctxs[r].store.peek(target)
        if want is not None:
            assert_tensor(got, want, what=f"rank {r}")
        elif target != "x" or r not in xs:
            assert got is None, f"rank {r} stored {target!r}"
        if r in xs and (target != "x" or want is None):
            assert torch.equal(cl.ctxs[r].store.peek("x"), before[r]), f"rank {r}'s input changed"
        if large:  # exchange + data collective + agreement
            moved = Counter({DATA_CALL[kind]: 1} if r in members else {})
            control = Counter({EXCHANGE: 2})
        else:  # the exchange alone
            moved, control = Counter(), Counter({EXCHANGE: 1})
        if data is cl.world:
            assert cl.calls[r] == control + moved, f"rank {r}: {cl.calls[r]}"
        else:
            assert cl.calls[r] == control, f"rank {r}: {cl.calls[r]}"
            if r in members:
                assert data_calls[members.index(r)] == moved, f"rank {r}: {data_calls}"
