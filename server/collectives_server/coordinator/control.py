"""The coordinator's guard: roles, lease secrets, size limits and stream caps, in one place.

:class:`ControlGuard` is what :class:`~.service.CoordinatorServicer` calls before
it lets a request change the membership; each check aborts the call with a clear
status and changes nothing when it refuses:

* worker-only RPCs without the worker token: PERMISSION_DENIED (:mod:`.admission`);
* Heartbeat/Leave without the worker's lease secret: PERMISSION_DENIED;
* a field over its limit: INVALID_ARGUMENT naming the field (:mod:`.registration`);
* Register at a live worker's address by another process: ALREADY_EXISTS;
* more than ``max_waiting_workers`` live workers beyond ``max_workers``, a
  registration that would take the Cluster message over its budget, or more than
  ``max_watch_streams`` WatchCluster streams (``max_watch_streams_per_peer`` from
  one host): RESOURCE_EXHAUSTED.

Not thread-safe: the servicer calls it with its lock held (except
:meth:`check_worker`, which reads only the call's metadata).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import NoReturn

import grpc

from collectives.v1 import coordinator_pb2, status_pb2
from collectives_server.coordinator.admission import LeaseBook, WorkerAdmission
from collectives_server.coordinator.membership import Membership
from collectives_server.coordinator.registration import (
    CLUSTER_BUDGET_BYTES,
    ClusterBudget,
    FieldTooLargeError,
    check_register,
    check_status,
    worker_entry_bytes,
)
from collectives_server.settings import non_negative_int, positive_int, setting

__all__ = ["ControlGuard", "ControlLimits", "peer_host"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ControlLimits:
    """The coordinator's bounds (flags of the same names)."""

    max_waiting_workers: int = setting(
        64,
        flag="--max-waiting-workers",
        parse=non_negative_int,
        metavar="N",
        help="live workers beyond --max-workers that may wait for a place; more "
        "registrations answer RESOURCE_EXHAUSTED",
    )
    max_watch_streams: int = setting(
        128,
        flag="--max-watch-streams",
        parse=positive_int,
        metavar="N",
        help="WatchCluster streams open at once; more answer RESOURCE_EXHAUSTED",
    )
    max_watch_streams_per_peer: int = setting(
        32,
        flag="--max-watch-streams-per-peer",
        parse=positive_int,
        metavar="N",
        help="WatchCluster streams open at once from one host",
    )
    cluster_budget_bytes: int = CLUSTER_BUDGET_BYTES

    def __post_init__(self) -> None:
        for name in ("max_waiting_workers", "max_watch_streams", "max_watch_streams_per_peer"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cluster_budget_bytes <= 0:
            raise ValueError(f"cluster_budget_bytes must be > 0, got {self.cluster_budget_bytes}")


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string ('ipv4:10.0.0.5:4711' -> 'ipv4:10.0.0.5')."""
    if peer.startswith(("ipv4:", "ipv6:")):
        host, sep, _port = peer.rpartition(":")
        return host if sep else peer
    return peer


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


class ControlGuard:
    def __init__(self, limits: ControlLimits | None = None, worker_token: str | None = None):
        self.limits = limits or ControlLimits()
        self.admission = WorkerAdmission(worker_token)
        self.leases = LeaseBook()
        self.budget = ClusterBudget(self.limits.cluster_budget_bytes)
        self._watch_total = 0
        self._watch_by_peer: collections.Counter[str] = collections.Counter()
        self._refused: collections.Counter[str] = collections.Counter()
        self._refused_lock = threading.Lock()  # check_worker refuses outside the servicer's lock

    # ---- roles ---------------------------------------------------------------

    def check_worker(self, context: grpc.ServicerContext, rpc: str) -> None:
        """Aborts PERMISSION_DENIED when a worker token is required and missing or wrong."""
        problem = self.admission.problem(context.invocation_metadata())
        if problem is not None:
            self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, rpc, problem)

    def check_lease(
        self,
        context: grpc.ServicerContext,
        rpc: str,
        membership: Membership,
        worker_id: str,
        secret: str,
    ) -> None:
        """Aborts PERMISSION_DENIED unless ``secret`` is live worker ``worker_id``'s lease secret.

        Unknown and LOST ids pass: the membership answers NOT_FOUND (register again).
        """
        if not membership.is_live(worker_id):
            return
        problem = self.leases.problem(worker_id, secret)
        if problem is not None:
            self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, rpc, problem)

    # ---- registration --------------------------------------------------------

    def check_register(
        self,
        context: grpc.ServicerContext,
        request: coordinator_pb2.RegisterRequest,
        membership: Membership,
        gone: Collection[str] = (),
    ) -> None:
        """Everything that refuses a Register before the membership sees it. ``gone``:
        live workers whose heartbeat stream closed (their process may have ended): a new
        process registering at one's address replaces it (the old one is declared LOST),
        as a restart that bound the port first proves it is no longer serving there."""
        try:
            check_register(request)
        except FieldTooLargeError as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "Register", str(exc))
        holder = membership.live_worker_at(request.address)
        if holder is not None:
            if self.leases.is_retry(holder, request.retry_key):
                return  # the same process again: it gets its id and secret back
            if holder in gone:
                return  # its stream closed and a new process serves its address
            self._refuse(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                "Register",
                f"address {request.address!r} is held by live worker {holder}; a worker "
                f"restarted there can register once that one leaves or misses its "
                f"{membership.lease_s:g} s lease",
            )
        if membership.waiting >= self.limits.max_waiting_workers:
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "Register",
                f"{membership.waiting} workers already wait for a place (max workers "
                f"{membership.max_workers}, --max-waiting-workers "
                f"{self.limits.max_waiting_workers}); retry later",
            )
        extra = worker_entry_bytes(request)
        if not self.budget.fits(extra):
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "Register",
                f"the Cluster message would outgrow its {self.budget.budget_bytes} byte budget "
                f"(now ~{self.budget.estimate} bytes, this worker adds {extra})",
            )

    def registered(
        self, worker_id: str, request: coordinator_pb2.RegisterRequest, *, retry: bool
    ) -> str:
        """Records an accepted registration; returns its lease secret."""
        if not retry:
            self.budget.admit(worker_entry_bytes(request))
        return self.leases.issue(worker_id, request.retry_key)

    def left(self, worker_id: str) -> None:
        self.leases.forget(worker_id)

    def reap(self, membership: Membership) -> None:
        """Forgets leases and status sizes of workers no longer live or listed."""
        self.leases.keep_only(w for w in membership.listed() if membership.is_live(w))
        self.budget.forget_except(membership.listed())

    # ---- heartbeat status ----------------------------------------------------

    def check_status(
        self, context: grpc.ServicerContext, rpc: str, status: status_pb2.WorkerStatus
    ) -> int:
        """The status's encoded size; aborts INVALID_ARGUMENT over the per-status limit."""
        try:
            return check_status(status)
        except FieldTooLargeError as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, rpc, str(exc))

    def admit_status(self, worker_id: str, size: int) -> bool:
        """Whether a status of ``size`` bytes fits the budget (and counts it if so)."""
        if not self.budget.fits(self.budget.status_delta(worker_id, size)):
            self._count("status_over_budget")
            log.warning(
                "status of %s (%d bytes) dropped: the Cluster message would outgrow "
                "its %d byte budget",
                worker_id,
                size,
                self.budget.budget_bytes,
            )
            return False
        self.budget.set_status(worker_id, size)
        return True

    # ---- watch streams ---------------------------------------------------------

    def open_watch(self, context: grpc.ServicerContext) -> str:
        """Counts a WatchCluster stream in (RESOURCE_EXHAUSTED beyond a cap); returns its key."""
        peer = peer_host(context.peer() or "")
        limits = self.limits
        if self._watch_total >= limits.max_watch_streams:
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "WatchCluster",
                f"{self._watch_total} streams already open (--max-watch-streams "
                f"{limits.max_watch_streams}); poll GetCluster instead, or retry later",
            )
        if self._watch_by_peer[peer] >= limits.max_watch_streams_per_peer:
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "WatchCluster",
                f"{self._watch_by_peer[peer]} streams already open from this host "
                f"(--max-watch-streams-per-peer {limits.max_watch_streams_per_peer}); "
                "poll GetCluster instead, or retry later",
            )
        self._watch_total += 1
        self._watch_by_peer[peer] += 1
        return peer

    def close_watch(self, peer: str) -> None:
        self._watch_total -= 1
        self._watch_by_peer[peer] -= 1
        if self._watch_by_peer[peer] <= 0:
            del self._watch_by_peer[peer]

    @property
    def watch_streams(self) -> int:
        return self._watch_total

    def refused(self) -> dict[str, int]:
        """Refusals so far by reason (the status code's name, or "status_over_budget")."""
        with self._refused_lock:
            return dict(self._refused)

    def _count(self, reason: str) -> None:
        with self._refused_lock:
            self._refused[reason] += 1

    def _refuse(
        self, context: grpc.ServicerContext, code: grpc.StatusCode, rpc: str, message: str
    ) -> NoReturn:
        self._count(code.name.lower())
        log.warning("refused %s from %s: %s", rpc, context.peer(), message)
        _abort(context, code, f"{rpc}: {message}")
