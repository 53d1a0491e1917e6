"""Drains and rolling restarts, as the coordinator runs them (``Coordinator.Drain``).

A drain hands one member's rank to a live spare: the coordinator seals the next
generation with the spare in that rank, the spare copies the member's tensors
straight from it, and the members join the new generation once the copy is in
(see ``docs/deploying.md``, "Replacing a worker"). The drained worker then exits
0, so its supervisor starts it again and it registers as the next spare. A
*rollout* drains every member in turn, each once a spare is live.

``cluster.drain`` and the ``collectives drain`` / ``collectives rollout``
commands call these with the coordinator's stub.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from collectives.errors import DeadlineExceeded, InvalidArgument, from_rpc_error
from collectives.transport.channels import call_unary
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives.wire.cluster_state import ClusterSnapshot, DrainReport, WorkerState

__all__ = ["DRAIN_OP_TIMEOUTS", "drain", "has_spare", "rollout", "wait_for"]

# A drain's handoff may take this many op timeouts unless the caller says otherwise
# (the coordinator's default too).
DRAIN_OP_TIMEOUTS = 4
# Beyond the handoff's own time: the members join the new generation, the answer arrives.
_ANSWER_MARGIN_S = 5.0


def drain(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    worker: str,
    *,
    shrink: bool,
    timeout: float | None,
    op_timeout_s: float,
) -> DrainReport:
    """Drains ``worker`` (an address or worker id); its report once the next
    generation serves. ``timeout`` bounds the handoff (None: 4 op timeouts).

    Raises:
        InvalidArgument: ``worker`` is empty.
        NotFound: no live worker is ``worker``.
        FailedPrecondition: it is not a member, another drain runs, or no spare is
            live (and not ``shrink``).
        Aborted: the handoff failed or lost a worker; the message says which.
        DeadlineExceeded: the handoff did not end within ``timeout``.
    """
    if not isinstance(worker, str) or not worker.strip():
        raise InvalidArgument(
            f"drain needs a worker's address or id, as workers() lists it; got {worker!r}"
        )
    handoff_s = DRAIN_OP_TIMEOUTS * op_timeout_s if timeout is None else timeout
    request = coordinator_pb2.DrainRequest(
        worker=worker.strip(), shrink=shrink, timeout_s=handoff_s
    )
    answer = call_unary(
        stub.Drain,
        request,
        handoff_s + op_timeout_s + _ANSWER_MARGIN_S,
        f"drain of {worker}",
    )
    return DrainReport.from_proto(answer)


def wait_for(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    predicate: Callable[[ClusterSnapshot], bool],
    timeout: float,
    what: str,
) -> ClusterSnapshot:
    """The first view (``WatchCluster``) for which ``predicate`` holds.

    Raises:
        DeadlineExceeded: none within ``timeout`` seconds (the message says ``what``).
        CollectiveError: the coordinator could not be reached.
    """
    deadline = time.monotonic() + timeout
    last: ClusterSnapshot | None = None
    call = stub.WatchCluster(coordinator_pb2.WatchClusterRequest(), timeout=timeout)
    try:
        for msg in call:
            last = ClusterSnapshot.from_proto(msg)
            if predicate(last):
                return last
            if time.monotonic() >= deadline:
                break
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise from_rpc_error(err, f"watching for {what}") from None
    finally:
        call.cancel()
    shown = f" (last status: {last.status})" if last is not None else ""
    raise DeadlineExceeded(f"no {what} within {timeout:g} s{shown}")


def has_spare(snapshot: ClusterSnapshot) -> bool:
    """A formed, ready cluster with a live spare and no drain running."""
    return (
        snapshot.formed
        and snapshot.ready
        and snapshot.drain is None
        and any(w.state is WorkerState.SPARE for w in snapshot.workers)
    )


def rollout(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    *,
    timeout: float,
    op_timeout_s: float,
    on_report: Callable[[DrainReport], None] = lambda report: None,
) -> list[DrainReport]:
    """Drains every member of the current generation once, in rank order: each
    when a spare is live (the one drained before restarts as the next), within
    ``timeout`` seconds per member. Stops at the first failed drain (raised).

    Raises:
        DeadlineExceeded: no spare became live within ``timeout``.
        CollectiveError: a drain failed (see :func:`drain`).
    """
    first = wait_for(stub, has_spare, timeout, "live spare in a ready cluster")
    reports = []
    for member in [w.worker_id for w in first.members]:
        snapshot = wait_for(stub, has_spare, timeout, "live spare in a ready cluster")
        if all(w.worker_id != member for w in snapshot.members):
            continue  # it left meanwhile (or was lost): nothing to hand over
        report = drain(stub, member, shrink=False, timeout=timeout, op_timeout_s=op_timeout_s)
        reports.append(report)
        on_report(report)
    return reports
