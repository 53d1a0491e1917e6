"""The ``collectives.v1.Coordinator`` gRPC servicer: protobuf in, membership calls, protobuf out.

Everything that decides lives in :mod:`.membership`; this module only translates,
serialises access with one lock, and wakes ``WatchCluster`` streams. The lock is
the monitor of a :class:`threading.Condition` that is notified whenever the
membership ``version`` changes, so a stream sends a new Cluster message as soon as
something visible changed, without polling. Each stream also registers an RPC
termination callback that notifies the condition, so cancelled streams end at
once; the wait's timeout is only a safety net.

A watch stream holds a server thread for its lifetime, so their number is capped
(``--max-watch-streams``, and ``--max-watch-streams-per-peer`` from one host):
beyond it, WatchCluster answers RESOURCE_EXHAUSTED and the threads stay available
for Register and Heartbeat. Roles, lease secrets and size limits are checked by
:class:`~.control.ControlGuard` before a request changes anything.

Heartbeats come once a second from every worker, so their cost bounds how many
workers one coordinator serves. A unary call costs the coordinator several times
what one message on an open stream does (grpcio's per-call work: a new call, thread
pool hand-offs, metadata and status), so workers
send them on ``HeartbeatStream``, which is answered only when a request asks
(``want_reply``: an answer costs about as much again). Such a stream also
holds a server thread for its lifetime; the daemon sizes the pool for one per
worker, and beyond ``max_heartbeat_streams`` the call answers RESOURCE_EXHAUSTED
and workers fall back to unary Heartbeat. A stream whose worker was declared
LOST is cancelled, so a connection that died silently does not keep its thread.

With an etcd store, a read (``GetCluster``, and every message of a
``WatchCluster`` stream) is answered only with a membership as new as the one
etcd stores: a leader's own while its lease is fresh or etcd confirms it still
leads; a standby's copy once etcd says its revision is the stored one (fetching
the stored one first when it is not). When that cannot be shown (etcd does not
answer, the copy cannot be brought up to date), the read fails with
UNAVAILABLE, saying the view may be stale, and the client asks another
coordinator: a client never sees a generation older than etcd's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives_server.coordinator.cluster_message import (
    cluster_to_proto,
    drain_report_to_proto,
    status_key,
)
from collectives_server.coordinator.control import ControlGuard
from collectives_server.coordinator.crash_probe import process_gone
from collectives_server.coordinator.ha.etcd_replication import EtcdReplication
from collectives_server.coordinator.ha.etcd_store import StoreUnavailableError
from collectives_server.coordinator.ha.replication import InMemory, Replication
from collectives_server.coordinator.membership import (
    ClusterView,
    InvalidRequestError,
    Membership,
    Outcome,
    UnknownWorkerError,
)
from collectives_server.coordinator.vocabulary import (
    DrainRefusedError,
    DrainReport,
    HandoffOutcome,
)
from collectives_server.coordinator.worker_records import validate_registration

__all__ = ["SERVICE_NAME", "CoordinatorServicer"]

SERVICE_NAME = "collectives.v1.Coordinator"

log = logging.getLogger(__name__)

# Safety net for WatchCluster waits; streams normally wake on a notification.
_WATCH_WAKE_S = 5.0
# Reads of etcd one read may make to bring a standby's copy up to the stored document.
_CATCH_UP_ATTEMPTS = 3
# A drain's handoff may take this many op timeouts unless the request says otherwise.
_DRAIN_TIMEOUT_OP_TIMEOUTS = 4
# A Cluster message is shared by the reads of one version within this long (its
# heartbeat ages and uptimes are as old as that at most).
_SHARED_CLUSTER_S = 0.1
_DRAIN_REFUSALS = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Serves one :class:`Membership` over gRPC. ``clock`` is monotonic seconds."""

    def __init__(
        self,
        membership: Membership,
        *,
        heartbeat_s: float,
        op_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        guard: ControlGuard | None = None,
        max_heartbeat_streams: int = 1024,
        identity: str = "",
        replication: Replication | None = None,
    ) -> None:
        self._membership = membership
        membership.sealer = identity
        # Where decisions are kept (see .ha.replication): this process alone by default,
        # else leader or standby of an HA set.
        self._replication: Replication = replication or InMemory(identity)
        self._heartbeat_s = heartbeat_s
        self._op_timeout_s = op_timeout_s
        self._clock = clock
        self.guard = guard or ControlGuard()
        self._measured_version = -1  # version of the last Cluster message measured
        # The last Cluster message built: (its version and leader, when, the message).
        self._shared_cluster: tuple[tuple[int, str, str], float, coordinator_pb2.Cluster] | None
        self._shared_cluster = None
        self._max_heartbeat_streams = max_heartbeat_streams
        # Open HeartbeatStream calls -> the worker id of their last request ("" before one).
        self._heartbeat_streams: dict[grpc.ServicerContext, str] = {}
        # Live workers whose heartbeat stream closed and opened no other since.
        self._streams_closed: set[str] = set()
        self._lost_seen = 0  # membership.events["lost"] when streams were last reaped
        self._closed = False
        # Set by close(): crash probes of closed heartbeat streams stop waiting.
        self._closing = threading.Event()
        self._notified_version = membership.version
        self._cond = threading.Condition(threading.Lock())
        self._heartbeats_received = 0
        # With an etcd store: whether the membership is this leader's own (taken over
        # and deciding), else the etcd revision of the document it copies (-1: none).
        self._own_state = self._replication.leading  # the memory store's always is
        self._copy_revision = -1

    # ---- used by the daemon ----------------------------------------------------

    def tick(self) -> None:
        """Applies lease expiry and the join window; called periodically.

        Also cancels the heartbeat streams of workers declared LOST since the last
        tick: a stream whose connection died without a reset would otherwise hold
        its server thread until TCP gives up.
        """
        with self._cond:
            if not self.is_leader:
                return  # a standby's copy changes only with the leader's document
            if self._replication.held is not None:
                self._persist(retry=True)
            self._apply(self._membership.tick(self._clock()))
            if self._membership.events["lost"] != self._lost_seen:
                self.guard.reap(self._membership)
            stale = self._streams_of_lost_workers()
        for context in stale:
            context.cancel()

    # ---- leadership (called by the election thread of an etcd store) ----------------

    def set_identity(self, address: str) -> None:
        """This coordinator's address (known once its server listens): seals are signed so."""
        with self._cond:
            self._membership.sealer = address
            self._replication.set_identity(address)

    @property
    def is_leader(self) -> bool:
        """Whether this coordinator decides membership (always, with the memory store).

        With etcd: it holds the leadership *and* has taken over, so its membership is
        its own. Between the election thread winning and :meth:`on_leadership` taking
        over, it still holds a standby's copy: calls are refused as by a standby
        (UNAVAILABLE, retry), never decided on the copy.
        """
        return self._replication.leading and self._own_state

    def on_leadership(self, leading: bool) -> None:
        """Takes over from the stored state, or becomes a standby.

        A leader that steps down keeps its membership, but serves it to nobody
        until it holds a copy of the stored document again (:meth:`on_state`).
        """
        replication = self._etcd()
        failed: Exception | None = None
        with self._cond:
            if leading:
                try:
                    membership, outcome = replication.take_over(self.guard.leases, self._cluster_of)
                except (StoreUnavailableError, KeyError, ValueError) as exc:
                    failed = exc
                else:
                    self._membership = membership
                    self._own_state = True
                    self._persist(retry=True)
                    self._log_outcome(outcome)
                    log.info("leading: %s", self._membership.status)
            elif self._own_state:
                self._own_state = False
                self._copy_revision = -1  # its own decisions are no copy of etcd's
            streams = [] if leading else list(self._heartbeat_streams)
            self._notify_if_changed()
        if failed is not None:  # outside the lock: stepping down calls us back
            log.error("could not take over: %s", failed)
            replication.leadership.step_down(f"the stored state is unreadable: {failed}")
        for context in streams:  # their workers heartbeat through us to the new leader
            context.cancel()

    def on_reach(self, reached: bool) -> None:
        """etcd answers again, or has not for a TTL: watch streams re-check (and end)."""
        with self._cond:
            self._cond.notify_all()

    def on_state(self, doc: dict | None, revision: int) -> None:
        """A standby's copy follows the document the leader wrote (etcd ``revision``;
        ``doc`` None and revision 0 while etcd holds none). Copies only move forward."""
        replication = self._etcd()
        with self._cond:
            if replication.leading:
                return
            if not self._own_state and revision <= self._copy_revision:
                return  # this copy, or a newer one, is already held
            try:
                self._membership = replication.replica(doc, self.guard.leases)
            except (KeyError, ValueError) as exc:
                log.error("unreadable membership document in etcd: %s", exc)
                return
            self._own_state = False
            self._copy_revision = revision
            self._notify_if_changed()

    def close(self) -> None:
        """Ends every WatchCluster and HeartbeatStream stream; later calls answer UNAVAILABLE."""
        self._closing.set()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            streams = list(self._heartbeat_streams)
        for context in streams:
            context.cancel()

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
    def heartbeat_streams(self) -> int:
        """HeartbeatStream calls open now (workers heartbeating on a stream)."""
        with self._cond:
            return len(self._heartbeat_streams)

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
                lambda: self._closed or self._visible_version() > after_version,
                timeout=timeout_s,
            )
            if self._closed or self._visible_version() <= after_version:
                return None
            return self._cluster()

    # ---- RPCs ------------------------------------------------------------------

    def Register(
        self, request: coordinator_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        self.guard.check_worker(context, "Register")
        if self._standby():
            return self._replication.forward("Register", request, context)
        with self._cond:
            self._check_open(context)
            self.guard.check_register(context, request, self._membership, self._streams_closed)
            try:
                validate_registration(request.address, tuple(request.devices))
                if not 0 < request.store_port < 65536:
                    raise InvalidRequestError(
                        f"store_port {request.store_port} is not a port: every worker hosts "
                        "the rendezvous TCPStore its generations may meet in, and registers "
                        "with its port"
                    )
            except InvalidRequestError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Register: {exc}")
            holder = self._membership.live_worker_at(request.address)
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
                    store_port=request.store_port,
                )
            except InvalidRequestError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Register: {exc}")
            secret = self.guard.registered(worker_id, request, retry=worker_id == holder)
            self._apply(outcome)
        return coordinator_pb2.RegisterResponse(
            worker_id=worker_id,
            lease_secret=secret,
            heartbeat_interval_s=self._heartbeat_s,
            lease_s=self._membership.lease_s,
            op_timeout_s=self._op_timeout_s,
        )

    def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        self.guard.check_worker(context, "Heartbeat")
        if self._standby():
            return self._replication.forward("Heartbeat", request, context)
        return self._heartbeat(request, context, "Heartbeat")

    def HeartbeatStream(
        self,
        request_iterator: Iterator[coordinator_pb2.HeartbeatRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[coordinator_pb2.HeartbeatResponse]:
        self.guard.check_worker(context, "HeartbeatStream")
        with self._cond:
            self._check_open(context)
            self._check_leading(context, "HeartbeatStream")
            if len(self._heartbeat_streams) >= self._max_heartbeat_streams:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"HeartbeatStream: {len(self._heartbeat_streams)} streams already open "
                    "(the limit); send unary Heartbeat calls instead",
                )
            self._heartbeat_streams[context] = ""
        try:
            for request in request_iterator:
                response = self._heartbeat(request, context, "HeartbeatStream", stream=True)
                if request.want_reply:
                    yield response
        finally:
            with self._cond:
                worker_id = self._heartbeat_streams.pop(context)
                address = None if self._closed else self._membership.address_of(worker_id)
                if address is not None:
                    self._streams_closed.add(worker_id)
                # Forget the ones no longer live (bounded by the workers listed).
                self._streams_closed &= set(self._membership.listed())
            if address is not None and self.is_leader:
                threading.Thread(
                    target=self._check_crash,
                    args=(worker_id, address),
                    name="crash-probe",
                    daemon=True,
                ).start()

    def Leave(
        self, request: coordinator_pb2.LeaveRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.LeaveResponse:
        self.guard.check_worker(context, "Leave")
        if self._standby():
            return self._replication.forward("Leave", request, context)
        with self._cond:
            self._check_open(context)
            self.guard.check_lease(
                context, "Leave", self._membership, request.worker_id, request.lease_secret
            )
            try:
                outcome = self._membership.leave(self._clock(), request.worker_id)
            except UnknownWorkerError as exc:
                self._notify_if_changed()
                context.abort(grpc.StatusCode.NOT_FOUND, f"Leave: {exc}")
            self.guard.left(request.worker_id)
            self._apply(outcome)
        return coordinator_pb2.LeaveResponse()

    def Drain(
        self, request: coordinator_pb2.DrainRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.DrainReport:
        """Starts a drain, then answers its report once the handoff ended and the next
        generation is ready (or, failed, at once; see the proto). A drain asked for a
        worker whose drain is in progress answers that drain's report (the worker's own
        SIGTERM, a preStop hook and an operator may all ask for it)."""
        if self._standby():
            return self._replication.forward("Drain", request, context, long=True)
        timeout_s = request.timeout_s or _DRAIN_TIMEOUT_OP_TIMEOUTS * self._op_timeout_s
        if not 0 < timeout_s <= 3600:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Drain: timeout_s {request.timeout_s:g} is not in (0, 3600]",
            )
        with self._cond:
            self._check_open(context)
            outcome: Outcome | None = None
            try:
                outcome = self._membership.drain(
                    self._clock(), request.worker, shrink=request.shrink, timeout_s=timeout_s
                )
            except DrainRefusedError as exc:
                if not self._draining(request.worker):
                    context.abort(_DRAIN_REFUSALS[exc.code], f"Drain: {exc}")
            handoff = self._membership.handoff
            assert handoff is not None
            if outcome is not None:
                self._apply(outcome)
            waited_until = time.monotonic() + timeout_s + self._op_timeout_s
            report: DrainReport | None = None

            def ended() -> bool:
                nonlocal report
                report = next(
                    (
                        r
                        for r in reversed(self._membership.drains)
                        if r.drain_id == handoff.drain_id
                    ),
                    None,
                )
                return self._closed or report is not None

            self._cond.wait_for(ended, timeout=max(0.0, waited_until - time.monotonic()))
            pending = self._membership.handoff
            same = pending is not None and pending.drain_id == handoff.drain_id
            if report is None and not self._closed and same:
                if outcome is None:  # another call's drain: that call decides its end
                    context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"Drain: the drain of {handoff.drained} in progress did not end "
                        "within this call's timeout",
                    )
                why = "the Drain call's own deadline passed first"
                self._apply(self._membership.call_off_handoff(self._clock(), why))
                ended()
            if report is None:
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, "Drain: the coordinator is shutting down"
                )
            unix_offset_s = time.time() - self._clock()
            answer = drain_report_to_proto(report, unix_offset_s)
            if report.error:
                code = grpc.StatusCode.ABORTED
                if "did not end within" in report.error:
                    code = grpc.StatusCode.DEADLINE_EXCEEDED
                context.abort(code, f"Drain of {report.worker_id}: {report.error}")
            # Answer once the members serve the new generation, within the call's time.
            self._cond.wait_for(
                lambda: self._closed or self._membership.ready,
                timeout=max(0.0, waited_until - time.monotonic()),
            )
        return answer

    def _draining(self, worker: str) -> bool:
        """Whether ``worker`` (an id or address) is the one the drain in progress drains."""
        h = self._membership.handoff
        return h is not None and worker in (h.drained, self._membership.address_of(h.drained))

    def GetCluster(
        self, request: coordinator_pb2.GetClusterRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.Cluster:
        return self._current_cluster(context, "GetCluster")

    def WatchCluster(
        self, request: coordinator_pb2.WatchClusterRequest, context: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.Cluster]:
        self._check_reachable(context, "WatchCluster")
        with self._cond:
            self._check_open(context)
            peer = self.guard.open_watch(context)
        ended = threading.Event()

        def on_end() -> None:
            ended.set()
            with self._cond:
                self._cond.notify_all()

        context.add_callback(on_end)
        last = request.after_version
        try:
            while (woke_at := self._next_change(last, ended, context)) is not None:
                msg = self._current_cluster(context, "WatchCluster")
                if msg.version > last:
                    last = msg.version
                    yield msg
                else:  # the current view is no newer than the last one sent: wait for more
                    last = woke_at
        finally:
            with self._cond:
                self.guard.close_watch(peer)
        self._check_reachable(context, "WatchCluster")

    def _next_change(
        self, after_version: int, ended: threading.Event, context: grpc.ServicerContext
    ) -> int | None:
        """Blocks until the visible version passes ``after_version`` and returns it;
        None when the stream must end."""
        with self._cond:
            while True:
                self._cond.wait_for(
                    lambda: (
                        self._closed
                        or ended.is_set()
                        or self._visible_version() > after_version
                        or self._replication.cut_off
                    ),
                    timeout=_WATCH_WAKE_S,
                )
                gone = self._closed or ended.is_set() or not context.is_active()
                if gone or self._replication.cut_off:
                    return None
                if self._visible_version() > after_version:
                    return self._visible_version()

    def _heartbeat(
        self,
        request: coordinator_pb2.HeartbeatRequest,
        context: grpc.ServicerContext,
        rpc: str,
        *,
        stream: bool = False,
    ) -> coordinator_pb2.HeartbeatResponse:
        """One heartbeat, from a unary call or a stream; aborts the call on NOT_FOUND."""
        has_status = request.HasField("status")
        size = self.guard.check_status(context, rpc, request.status) if has_status else 0
        key = status_key(request.status) if has_status else None
        with self._cond:
            self._check_open(context)
            self._check_leading(context, rpc)
            self._heartbeats_received += 1
            self.guard.check_lease(
                context, rpc, self._membership, request.worker_id, request.lease_secret
            )
            if has_status and self._membership.is_live(request.worker_id):
                has_status = self.guard.admit_status(request.worker_id, size)
            try:
                outcome = self._membership.heartbeat(
                    self._clock(),
                    request.worker_id,
                    joined_generation=request.joined_generation,
                    busy=request.busy,
                    status=request.status if has_status else None,
                    status_key=key,
                    handoff_bytes_copied=request.handoff_bytes_copied,
                    prepared_generation=request.prepared_generation,
                    prepared_digest=request.prepared_digest,
                )
            except UnknownWorkerError as exc:
                self._notify_if_changed()
                context.abort(grpc.StatusCode.NOT_FOUND, f"{rpc}: {exc}")
            if stream:
                self._heartbeat_streams[context] = request.worker_id
                self._streams_closed.discard(request.worker_id)
            self._apply(outcome, quiet=True)
            if request.HasField("handoff_result"):
                r = request.handoff_result
                result = HandoffOutcome(
                    generation_after=r.generation_after,
                    ok=r.ok,
                    error=r.error,
                    tensors=r.tensors,
                    bytes=r.bytes,
                    seconds=r.seconds,
                    lost=tuple(r.lost),
                    models=r.models,
                )
                now = self._clock()
                self._apply(self._membership.handoff_result(now, request.worker_id, result))
            held = self._replication.held
            if held is not None:  # a change waits for etcd: nobody hears of it yet
                return coordinator_pb2.HeartbeatResponse(
                    generation=held.generation, version=held.version
                )
            return coordinator_pb2.HeartbeatResponse(
                generation=self._membership.generation, version=self._membership.version
            )

    def _check_crash(self, worker_id: str, address: str) -> None:
        """After ``worker_id``'s heartbeat stream closed: if nothing listens at its
        address any more, its process is gone; it is lost now, and the survivors re-form
        without waiting for its lease (see :mod:`.crash_probe`)."""

        def still_suspect() -> bool:
            with self._cond:
                return (
                    worker_id in self._streams_closed
                    and self._membership.address_of(worker_id) == address
                )

        # Until its lease would end it anyway: a listener can outlive the stream a
        # while on a busy host (the kernel closes a killed process's sockets in turn).
        if not process_gone(address, self._closing, self._membership.lease_s, still_suspect):
            return
        with self._cond:
            if self._closed or not self.is_leader:
                return
            if self._membership.address_of(worker_id) != address:
                return  # it left, was lost, or re-registered meanwhile
            evidence = "its heartbeat stream closed and nothing listens at its address"
            self._apply(self._membership.crashed(self._clock(), worker_id, evidence))
            stale = self._streams_of_lost_workers()
        for context in stale:
            context.cancel()

    # ---- helpers (call with the lock held) -------------------------------------

    def _streams_of_lost_workers(self) -> list[grpc.ServicerContext]:
        """Heartbeat streams whose worker is no longer live; scans only after a loss."""
        lost = self._membership.events["lost"]
        if lost == self._lost_seen:
            return []
        self._lost_seen = lost
        return [
            context
            for context, worker_id in self._heartbeat_streams.items()
            if worker_id and not self._membership.is_live(worker_id)
        ]

    def _cluster(self) -> coordinator_pb2.Cluster:
        """The current Cluster message, shared (read it, never change it): every watcher
        woken by one change gets the message built once, instead of each building its
        own under the lock while the last one's workers wait."""
        held = self._replication.held
        if held is not None:
            return held
        key = (self._membership.version, self._replication.leader, self._replication.store)
        now = time.monotonic()
        cached = self._shared_cluster
        if cached is not None and cached[0] == key and now - cached[1] < _SHARED_CLUSTER_S:
            return cached[2]
        msg = self._cluster_of(self._membership)
        self._shared_cluster = (key, now, msg)
        return msg

    def _cluster_of(self, membership: Membership) -> coordinator_pb2.Cluster:
        """The Cluster message of ``membership`` (not yet this servicer's own)."""
        msg = self._build_cluster(membership)
        msg.leader = self._replication.leader
        msg.store = self._replication.store
        return msg

    def _build_cluster(self, membership: Membership | None = None) -> coordinator_pb2.Cluster:
        now = self._clock()
        msg = cluster_to_proto(
            (membership or self._membership).view(now),
            op_timeout_s=self._op_timeout_s,
            unix_offset_s=time.time() - now,
        )
        if msg.version != self._measured_version:  # once per version, not per watcher
            self._measured_version = msg.version
            self.guard.budget.measured(msg.ByteSize())
        return msg

    def _standby(self) -> bool:
        return not self.is_leader

    def _check_leading(self, context: grpc.ServicerContext, rpc: str) -> None:
        if self._replication.leading and not self._own_state:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{rpc}: this coordinator is taking over as leader; retry with backoff",
            )
        if self._standby():
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{rpc}: this coordinator is a standby (leader: "
                f"{self._replication.leader or 'none yet'}); send unary calls, it forwards them",
            )

    def _check_reachable(self, context: grpc.ServicerContext, rpc: str) -> None:
        """Refuses reads from a coordinator that lost etcd: its copy may be stale."""
        if self._replication.cut_off:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{rpc}: this coordinator has not reached etcd for over "
                f"{self._replication.ttl_s:g} s, so its view may be stale; "
                "ask another coordinator of the set",
            )

    def _current_cluster(self, context: grpc.ServicerContext, rpc: str) -> coordinator_pb2.Cluster:
        """The Cluster message for a read, shown to be as new as etcd's (see the module).

        Takes the lock only between reads of etcd. Aborts the call with
        UNAVAILABLE when this coordinator cannot show that its view is current.
        """
        if not self._replication.checks_reads:
            return self.snapshot()
        replication = self._etcd()
        self._check_reachable(context, rpc)
        leadership = replication.leadership
        asked = time.monotonic()
        why = "its copy could not be brought up to the document etcd stores"
        try:
            for _ in range(_CATCH_UP_ATTEMPTS):
                with self._cond:
                    own = self._own_state
                    if own and leadership.lease_fresh:
                        return self._cluster()
                if own:
                    if not leadership.confirm_leading():
                        why = "it led until now, and etcd names another leader or none"
                        break
                    with self._cond:
                        if self._own_state:
                            return self._cluster()
                    continue
                stored = leadership.state_revision(asked)
                with self._cond:
                    if not self._own_state and self._copy_revision == stored:
                        return self._cluster()
                    if not self._own_state and stored < self._copy_revision:
                        self._copy_revision = -1  # etcd's history restarted: take what it holds
                leadership.read_state()  # hands the stored document to on_state
        except StoreUnavailableError as exc:
            why = f"etcd did not answer the check of its copy ({exc})"
        except ValueError as exc:
            why = f"the document in etcd is unreadable ({exc})"
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"{rpc}: this coordinator's view may be stale: {why}; "
            "try another address of the coordinator set",
        )
        raise AssertionError("unreachable")  # context.abort raises

    def _visible_version(self) -> int:
        held = self._replication.held
        return held.version if held is not None else self._membership.version

    def _persist(self, retry: bool = False) -> None:
        """Leader: records the state before anyone sees it (nothing to do in memory)."""
        self._replication.persist(self._membership, self.guard.leases, self._cluster, retry=retry)

    def _etcd(self) -> EtcdReplication:
        """The HA set's strategy, for what only a coordinator of one does (take over,
        follow the stored document, show a read current): its election thread and
        reads with :attr:`Replication.checks_reads` call these."""
        if not isinstance(self._replication, EtcdReplication):
            raise AssertionError("only a coordinator of an HA set takes over or follows")
        return self._replication

    def _check_open(self, context: grpc.ServicerContext) -> None:
        if self._closed:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, "the coordinator is shutting down; retry with backoff"
            )

    def _apply(self, outcome: Outcome, *, quiet: bool = False) -> None:
        """Logs an outcome and wakes the watch streams if the version moved."""
        if outcome.changed and self._replication.leading:
            self._persist()
        self._log_outcome(outcome, quiet=quiet)
        self._notify_if_changed()

    def _log_outcome(self, outcome: Outcome, *, quiet: bool = False) -> None:
        if outcome.changed:
            loud = not quiet or outcome.sealed or outcome.lost
            log.log(
                logging.INFO if loud else logging.DEBUG,
                "%s [version %d; %s]",
                outcome.reason,
                self._membership.version,
                self._membership.status,
            )

    def _notify_if_changed(self) -> None:
        # Also after a failed Heartbeat or Leave: it may have expired leases (and sealed).
        if self._notified_version != self._visible_version():
            self._notified_version = self._visible_version()
            self._cond.notify_all()
