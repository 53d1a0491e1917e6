"""Several tensor ops announced together (``fusion``): one exchange, then each op alone.

Every rank prepares each op of the run as :func:`tensor_ops.run_tensor_op`
would (operand info, quota state, the fence on its target), exchanges all of
them in one all-gather (``agreement.exchange_fused``), then finishes the ops
one by one, in the leader's order, each on its own slice of the exchange:
the same decision, inline result or data path, agreement and commit as alone.
Results are yielded as each op finishes; the leader's generation loop answers the
run's clients together once it ended (those that finished before a later op
raised with their own results), so their RPC threads do not contend for the
GIL with the ops still running.
"""

from __future__ import annotations

from collections.abc import Iterator

from collectives.errors import CollectiveError
from collectives.v1 import worker_pb2
from collectives_server.worker.engine import agreement
from collectives_server.worker.engine.descriptor import Announced
from collectives_server.worker.engine.handlers.tensor_ops import Prepared, finish, prepare
from collectives_server.worker.engine.op_context import OpContext, OpResult

__all__ = ["run_fused"]


def run_fused(
    ctx: OpContext,
    items: list[tuple[worker_pb2.OpDescriptor, int | None]],
    pending: Announced | None = None,
) -> Iterator[OpResult | CollectiveError]:
    """Yields each op's outcome in order; a broken group raises ``GroupBroken`` from
    the op it broke in (the ones before it have finished and committed)."""
    prepared: list[Prepared] = []
    try:
        for desc, inline in items:
            prepared.append(prepare(ctx, desc, inline))
        parts = [(p.values, p.operand, p.inline or 0) for p in prepared]
        exchanged = ctx.call(agreement.exchange_fused, ctx.control, ctx.world_size, parts, pending)
        for p, mine in zip(prepared, exchanged, strict=True):
            try:
                yield finish(ctx, p, mine)
            finally:
                p.release()
    finally:
        for p in prepared:
            p.release()
