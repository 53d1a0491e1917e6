"""What an RPC that runs an op needs of this worker as its generation's leader.

Every collective, model op and point-to-point RPC ends the same way: find the
generation this worker leads (UNAVAILABLE when it leads none, or not the one
the client expected), admit the op into its queue and wait for its outcome
within the call's deadline (running it on the calling thread when the loop is
idle), and answer a committed collective with a ``CollectiveResponse``. Each
part of the Worker servicer (``service``, ``model_service``, ``p2p_service``)
takes one :class:`Leader`.
"""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from collectives.errors import DeadlineExceeded, Unavailable
from collectives.v1 import worker_pb2
from collectives.wire.dtypes import to_wire
from collectives.wire.op_specs import kind_name
from collectives_server.rpc.call_context import CallContext
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.engine.handlers.group_ops import group_not_found
from collectives_server.worker.engine.op_context import GroupEntry, OpResult

if TYPE_CHECKING:
    from collectives_server.worker.engine.generation import Generation

__all__ = ["Leader", "call_budget", "collective_response", "group_of"]


class Leader:
    """This worker's current generation, as the RPCs that submit ops to it see it."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx

    def generation(self, options: worker_pb2.OpOptions) -> Generation:
        """The generation this worker leads, checked against the one the client saw;
        raises UNAVAILABLE when the cluster is not formed or this worker is not rank 0."""
        runtime = self._ctx.runtime
        if runtime is None:
            raise Unavailable(
                f"the cluster is not formed ({self._ctx.cluster_status}); retry once it is",
                executed=False,
            )
        runtime.check_generation(options.generation, options.membership_digest)
        if not runtime.is_leader:
            raise Unavailable(
                f"this worker is rank {runtime.rank} of generation {runtime.generation}, not the "
                f"leader (rank 0 at {self._ctx.leader_address or 'unknown'}); "
                "send collectives to the leader",
                executed=False,
            )
        return runtime  # type: ignore[return-value]  # the leader's is a Generation

    def run(
        self,
        context: CallContext,
        generation: Generation,
        desc: worker_pb2.OpDescriptor,
        options: worker_pb2.OpOptions,
    ) -> Any:
        """Admits ``desc`` on the leader and waits within the call's deadline."""
        if options.reissued_from:
            self._ctx.stats.op_reissued()
        budget = max(call_budget(context, options, self._ctx.op_timeout_s), 0.0)
        ticket = generation.submit(
            desc,
            budget,
            options.generation,
            claim_if_idle=True,
            expected_digest=options.membership_digest,
            client=context.peer() if self._ctx.recorder.enabled else "",
        )
        if ticket.claimed:
            generation.run_claimed(ticket)  # the loop was idle: this thread runs the op
        try:
            return ticket.future.result(timeout=budget)
        except FutureTimeout:
            what = f"op {desc.op_id} ({kind_name(desc.kind)})"
            if generation.cancel(ticket):
                raise DeadlineExceeded(
                    f"{what} did not start within {budget:.1f}s "
                    f"(queue depth {generation.queue_depth}); it was dropped",
                    executed=False,
                ) from None
            raise DeadlineExceeded(
                f"{what} still running after {budget:.1f}s; it may still complete"
            ) from None


def call_budget(context: CallContext, options: worker_pb2.OpOptions, op_timeout_s: float) -> float:
    """How long the leader waits for an op: as long as its caller allows (the call's
    deadline, and the request's ``timeout_s``, the shorter), since an op made of
    several collectives (a publish's buckets) may rightly outlast one op timeout;
    twice the op timeout only for a call that carries neither."""
    limits = [t for t in (context.time_remaining(), options.timeout_s or None) if t is not None]
    return min(limits) if limits else 2 * op_timeout_s


def group_of(generation: Generation, group_id: int) -> GroupEntry:
    """The group ``group_id`` of ``generation``, or NOT_FOUND (one wording)."""
    group = generation.groups.get(group_id)
    if group is None:
        raise group_not_found(group_id, generation.generation)
    return group


def collective_response(result: OpResult) -> worker_pb2.CollectiveResponse:
    """The ``CollectiveResponse`` of a committed op (tensor ops, uneven all_to_all,
    exchange)."""
    return worker_pb2.CollectiveResponse(
        op_id=result.op_id,
        generation=result.generation,
        result_name=result.result_name,
        result_ranks=result.result_ranks,
        dtype=to_wire(result.dtype) if result.dtype is not None else 0,
        shape=list(result.shape),
        latency_s=result.latency_s,
    )
