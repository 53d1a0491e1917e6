"""The ``collectives.v1.Coordinator`` gRPC servicer: protobuf in, membership calls, protobuf out.

Everything that decides lives in :mod:`.membership`; this module only translates,
serialises access with one lock, and wakes ``WatchCluster`` streams. The lock is
the monitor of a :class:`threading.Condition` that is notified whenever the
membership ``version`` changes, so a stream sends a new Cluster message as soon as
something visible changed, without polling. Each stream also registers an RPC
termination callback that notifies the condition, so cancelled streams end at
once; the wait's timeout is only a safety net.

A watch stream holds a server thread for its lifetime, so their number is capped
(``max_watchers``): beyond it, WatchCluster answers RESOURCE_EXHAUSTED and the
threads stay available for Register and Heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc, status_pb2
from collectives_server.coordinator.membership import (
    ClusterView,
    InvalidRequestError,
    Membership,
    Outcome,
    UnknownWorkerError,
    WorkerState,
)

__all__ = ["SERVICE_NAME", "CoordinatorServicer"]

SERVICE_NAME = "collectives.v1.Coordinator"

log = logging.getLogger(__name__)

_STATE_TO_PROTO = {
    WorkerState.JOINING: coordinator_pb2.WORKER_STATE_JOINING,
    WorkerState.READY: coordinator_pb2.WORKER_STATE_READY,
    WorkerState.BUSY: coordinator_pb2.WORKER_STATE_BUSY,
    WorkerState.DRAINING: coordinator_pb2.WORKER_STATE_DRAINING,
    WorkerState.LOST: coordinator_pb2.WORKER_STATE_LOST,
}

# Safety net for WatchCluster waits; streams normally wake on a notification.
_WATCH_WAKE_S = 5.0


def status_key(status: status_pb2.WorkerStatus) -> bytes:
    """The status without the readings that change all the time (memory in use).

    Heartbeats whose key did not change do not push a new Cluster to watchers
    at once (see :mod:`.membership`).
    """
    stable = status_pb2.WorkerStatus()
    stable.CopyFrom(status)
    for device in stable.devices:
        device.memory_used_bytes = 0
    stable.process_rss_bytes = 0
    stable.host_memory_available_bytes = 0
    return stable.SerializeToString(deterministic=True)


def cluster_to_proto(
    view: ClusterView, *, store_address: str, op_timeout_s: float, unix_offset_s: float = 0.0
) -> coordinator_pb2.Cluster:
    """Builds the Cluster message from a membership snapshot.

    ``unix_offset_s`` turns the membership's clock into Unix time (history).
    """
    msg = coordinator_pb2.Cluster(
        generation=view.generation,
        formed=view.formed,
        world_size=view.world_size,
        store_address=store_address,
        version=view.version,
        min_workers=view.min_workers,
        max_workers=view.max_workers,
        status=view.status,
        op_timeout_s=op_timeout_s,
        ready=view.ready,
    )
    for w in view.workers:
        msg.workers.add(
            worker_id=w.worker_id,
            rank=w.rank,
            address=w.address,
            hostname=w.hostname,
            pid=w.pid,
            state=_STATE_TO_PROTO[w.state],
            devices=w.devices,
            joined_generation=w.joined_generation,
            last_heartbeat_age_s=w.last_heartbeat_age_s,
            backend=w.backend,
            uptime_s=w.uptime_s,
            version=w.version,
            status=w.status,
        )
    for record in view.history:
        msg.history.add(
            generation=record.generation,
            sealed_unix_time_s=record.sealed_at + unix_offset_s,
            world_size=record.world_size,
            members=record.members,
            reason=record.reason,
        )
    return msg


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Serves one :class:`Membership` over gRPC. ``clock`` is monotonic seconds."""

    def __init__(
        self,
        membership: Membership,
        *,
        store_address: str,
        heartbeat_s: float,
        op_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_watchers: int = 64,
    ) -> None:
        self._membership = membership
        self._store_address = store_address
        self._heartbeat_s = heartbeat_s
        self._op_timeout_s = op_timeout_s
        self._clock = clock
        self._max_watchers = max_watchers
        self._watchers = 0
        self._closed = False
        self._notified_version = membership.version
        self._cond = threading.Condition(threading.Lock())
        self._heartbeats_received = 0

    # ---- used by the daemon ----------------------------------------------------

    def tick(self) -> None:
        """Applies lease expiry and the join window; called periodically."""
        with self._cond:
            self._apply(self._membership.tick(self._clock()))

    def close(self) -> None:
        """Ends every WatchCluster stream; later calls answer UNAVAILABLE."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def snapshot(self) -> coordinator_pb2.Cluster:
        """The current Cluster message (for in-process callers and tests)."""
        with self._cond:
            return self._cluster()

    def metrics_snapshot(self) -> tuple[ClusterView, dict[str, int], int]:
        """(membership view, workers joined/lost/left so far, heartbeats received)."""
        with self._cond:
            view = self._membership.view(self._clock())
            return view, dict(self._membership.events), self._heartbeats_received

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (the coordinator is stopping)."""
        return self._closed

    def wait_for_change(
        self, after_version: int, timeout_s: float
    ) -> coordinator_pb2.Cluster | None:
        """The Cluster once its version passes ``after_version``, else None after ``timeout_s``.

        For in-process watchers (the dashboard's event stream): the same condition
        WatchCluster streams wait on. Returns None at once when closed.
        """
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or self._membership.version > after_version,
                timeout=timeout_s,
            )
            if self._closed or self._membership.version <= after_version:
                return None
            return self._cluster()

    # ---- RPCs ------------------------------------------------------------------

    def Register(
        self, request: coordinator_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        with self._cond:
            self._check_open(context)
            try:
                worker_id, outcome = self._membership.register(
                    self._clock(),
                    address=request.address,
                    hostname=request.hostname,
                    pid=request.pid,
                    devices=tuple(request.devices),
                    backend=request.backend,
                    version=request.version,
                    last_generation=max(request.last_generation, 0),
                )
            except InvalidRequestError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Register: {exc}")
            self._apply(outcome)
        return coordinator_pb2.RegisterResponse(
            worker_id=worker_id,
            heartbeat_interval_s=self._heartbeat_s,
            lease_s=self._membership.lease_s,
            store_address=self._store_address,
            op_timeout_s=self._op_timeout_s,
        )

    def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        has_status = request.HasField("status")
        key = status_key(request.status) if has_status else None
        with self._cond:
            self._check_open(context)
            self._heartbeats_received += 1
            try:
                outcome = self._membership.heartbeat(
                    self._clock(),
                    request.worker_id,
                    joined_generation=request.joined_generation,
                    busy=request.busy,
                    status=request.status if has_status else None,
                    status_key=key,
                )
            except UnknownWorkerError as exc:
                self._notify_if_changed()
                context.abort(grpc.StatusCode.NOT_FOUND, f"Heartbeat: {exc}")
            self._apply(outcome, quiet=True)
            return coordinator_pb2.HeartbeatResponse(
                generation=self._membership.generation, version=self._membership.version
            )

    def Leave(
        self, request: coordinator_pb2.LeaveRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.LeaveResponse:
        with self._cond:
            self._check_open(context)
            try:
                outcome = self._membership.leave(self._clock(), request.worker_id)
            except UnknownWorkerError as exc:
                self._notify_if_changed()
                context.abort(grpc.StatusCode.NOT_FOUND, f"Leave: {exc}")
            self._apply(outcome)
        return coordinator_pb2.LeaveResponse()

    def GetCluster(
        self, request: coordinator_pb2.GetClusterRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.Cluster:
        return self.snapshot()

    def WatchCluster(
        self, request: coordinator_pb2.WatchClusterRequest, context: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.Cluster]:
        with self._cond:
            self._check_open(context)
            if self._watchers >= self._max_watchers:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"WatchCluster: {self._watchers} streams already open (the limit); "
                    "poll GetCluster instead, or retry later",
                )
            self._watchers += 1
        ended = threading.Event()

        def on_end() -> None:
            ended.set()
            with self._cond:
                self._cond.notify_all()

        context.add_callback(on_end)
        last = request.after_version
        try:
            while (msg := self._next_change(last, ended, context)) is not None:
                last = msg.version
                yield msg
        finally:
            with self._cond:
                self._watchers -= 1

    def _next_change(
        self, after_version: int, ended: threading.Event, context: grpc.ServicerContext
    ) -> coordinator_pb2.Cluster | None:
        """Blocks until the version passes ``after_version``; None when the stream must end."""
        with self._cond:
            while True:
                self._cond.wait_for(
                    lambda: (
                        self._closed or ended.is_set() or self._membership.version > after_version
                    ),
                    timeout=_WATCH_WAKE_S,
                )
                if self._closed or ended.is_set() or not context.is_active():
                    return None
                if self._membership.version > after_version:
                    return self._cluster()

    # ---- helpers (call with the lock held) -------------------------------------

    def _cluster(self) -> coordinator_pb2.Cluster:
        now = self._clock()
        return cluster_to_proto(
            self._membership.view(now),
            store_address=self._store_address,
            op_timeout_s=self._op_timeout_s,
            unix_offset_s=time.time() - now,
        )

    def _check_open(self, context: grpc.ServicerContext) -> None:
        if self._closed:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, "the coordinator is shutting down; retry with backoff"
            )

    def _apply(self, outcome: Outcome, *, quiet: bool = False) -> None:
        """Logs an outcome and wakes the watch streams if the version moved."""
        if outcome.changed:
            loud = not quiet or outcome.sealed or outcome.lost
            log.log(
                logging.INFO if loud else logging.DEBUG,
                "%s [version %d; %s]",
                outcome.reason,
                self._membership.version,
                self._membership.status,
            )
        self._notify_if_changed()

    def _notify_if_changed(self) -> None:
        # Also after a failed Heartbeat or Leave: it may have expired leases (and sealed).
        if self._notified_version != self._membership.version:
            self._notified_version = self._membership.version
            self._cond.notify_all()
