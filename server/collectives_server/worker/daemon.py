"""The worker daemon: registration, heartbeats, following generations, serving.

A worker registers with the coordinator, renews its lease with heartbeats (on a
HeartbeatStream, with unary Heartbeat calls while no stream is up), and follows
the coordinator's WatchCluster stream. Each sealed generation that
includes it gets a fresh :class:`Generation` (its own process group);
the previous one is retired. The tensor store belongs to the daemon's
:class:`~collectives_server.worker.context.WorkerContext` (what its RPC
handlers, status and metrics read), not to the generation, so named tensors
survive every membership change. A worker that
was declared lost (it missed its lease, e.g. while stopped) registers again
and joins a later generation with its tensors intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import grpc
import torch
import torch.distributed as dist

import collectives_server
from collectives.errors import CollectiveError
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2
from collectives.wire.raw_tls import server_context
from collectives_server import gc_tuning as heap
from collectives_server.control_protocol import worker_metadata
from collectives_server.hosts import dialled_name
from collectives_server.membership_digest import membership_digest
from collectives_server.metrics import MetricsServer
from collectives_server.rpc.server import GRPC_OPTIONS, WORKER_OPTIONS, start_server
from collectives_server.signals import StopSignal
from collectives_server.store_socket import start_store
from collectives_server.worker.config import WorkerConfig
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.data.replaced_memory import ReplacedMemory, pool_bytes
from collectives_server.worker.data.shm_segments import WorkerSegments
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.drain_role import DrainRole, pending_handoff, preparing_handoff
from collectives_server.worker.engine.flight_recorder import FlightRecorder
from collectives_server.worker.engine.generation import (
    Generation,
    GenerationHooks,
    GenerationSpec,
)
from collectives_server.worker.engine.groups_ahead import AheadKey
from collectives_server.worker.engine.model_sync import receive_models
from collectives_server.worker.engine.op_context import OpResult
from collectives_server.worker.enrolment import bounded_status, register
from collectives_server.worker.heartbeats import HeartbeatStream, reply_interval_s
from collectives_server.worker.models.archive.upload import ModelUploads
from collectives_server.worker.models.registry import ModelRegistry
from collectives_server.worker.rpc.service import (
    SERVICE_NAME,
    WorkerService,
    add_worker_service,
    worker_handlers,
)
from collectives_server.worker.stats import WorkerStats
from collectives_server.worker.status import heartbeat_status, op_done, worker_state
from collectives_server.worker.transport.bulk import BulkListener
from collectives_server.worker.transport.lanes import (
    LANE_METHODS,
    CallLanes,
    lane_handlers,
    lane_interceptors,
)

__all__ = ["WorkerDaemon", "run_worker", "resolve_devices"]

log = logging.getLogger(__name__)

# After a heartbeat stream failed (other than NOT_FOUND), heartbeats go by unary calls
# for this many intervals before a new stream is tried (a coordinator at its stream
# limit answers each attempt with RESOURCE_EXHAUSTED).
_STREAM_RETRY_BEATS = 10
# Server-side wait of the rendezvous store this worker hosts (clients set their own).
_STORE_TIMEOUT_S = 300.0
# How long stopping waits for a generation being joined (see stop()).
_STOP_WAIT_S = 2.0
# A heartbeat thread that wakes this much later than asked says so (the process was held up).
_HELD_UP_S = 2.0
# Calls running when the worker stops may finish within this (gRPC's and the lanes').
_STOP_GRACE_S = 1.0
# How long a stop signal that arrived during start-up waits for start() to end (it
# ends at once unless blocked outside the coordinator call, e.g. binding a port).
_ABORT_START_WAIT_S = 10.0


class StoppedWhileStarting(Exception):
    """start() ended early: a stop signal arrived while it was still starting."""


def resolve_devices(requested: tuple[str, ...]) -> list[torch.device]:
    if requested:
        devices = [torch.device(d) for d in requested]
        for d in devices:
            if d.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {d} requested but CUDA is not available on this host")
            if d.type not in ("cpu", "cuda"):
                raise ValueError(f"device {d} is not supported; use cpu or cuda:N")
        return devices
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


class WorkerDaemon:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        devices = resolve_devices(config.devices)
        store = TensorStore(devices[0], limit_bytes=config.max_tensor_bytes)
        self.ctx = WorkerContext(
            config=config,
            devices=devices,
            backend="nccl" if devices[0].type == "cuda" else "gloo",
            store=store,
            models=ModelRegistry(
                devices,
                config.allow_factories,
                config.graph_ttl_s,
                quota=store,
                factory_batching=config.factory_batching,
            ),
            uploads=ModelUploads(config.model_upload, device=devices[0]),
            # /dev/shm segments created for clients' gets: bounded, reaped after a TTL.
            shm_segments=WorkerSegments(config.shm_limits, quota=store),
            stats=WorkerStats(),
            # Kept memory stays well inside a store limit, if any.
            replaced=ReplacedMemory(max_bytes=pool_bytes(store.limit_bytes)),
            op_timeout_s=config.op_timeout_s or 30.0,
            recorder=FlightRecorder(config.flight_recorder_ops),
        )
        WorkerSegments.sweep_stale()
        # The current generation (also ctx.runtime, for the handlers): set under _lock.
        self.runtime: Generation | None = None
        self._lease_secret = ""
        self.joined_generation = 0
        self._last_generation = 0
        self._store_address = ""
        self._heartbeat_s = 1.0
        self._lease_s = 5.0
        self._lock = threading.RLock()
        # Notified with each Cluster message taken in (drain_before_stop waits on it).
        self._views = threading.Condition(self._lock)
        self._stop = threading.Event()
        # Set by stop() and by a heartbeat stream that ended: the heartbeat loop acts at once.
        self._beat_wake = threading.Event()
        self._stream: HeartbeatStream | None = None  # owned by the heartbeat thread
        self._stream_retry_at = 0.0
        self._watch_call = None
        self._rendezvous = None  # torch.distributed.TCPStore hosted here (master side)
        self._store_port = 0
        self._server = None
        self._channel: grpc.Channel | None = None  # to the coordinator, opened by start()
        self._metrics: MetricsServer | None = None
        # Its part in a drain; set when it was drained: the process then stops.
        self.drained = threading.Event()
        self._drain = DrainRole(
            self.ctx,
            # A successor calls the drained worker as a client of this cluster does:
            # this worker's TLS settings towards the coordinator, its own server's token.
            dataclasses.replace(config.coordinator_security, token=config.security.token),
            wake_heartbeat=self._beat_wake.set,
            on_drained=self._drained,
        )
        self._cluster: coordinator_pb2.Cluster | None = None  # the last one watched
        # (generation, its sub-groups) of the generation this worker ran last.
        self._retired_groups: tuple[int, dict[int, tuple[int, ...]]] = (0, {})
        # Called once drained (run_worker wakes its main thread with it).
        self.on_drained: Callable[[], None] = lambda: None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.config.metrics_port is not None:
            from collectives_server.worker.metrics import worker_registry

            self._metrics = MetricsServer(
                worker_registry(self.ctx),
                self.config.metrics_host,
                self.config.metrics_port,
                "worker",
            )
        servicer = WorkerService(self.ctx)
        self._server = start_server(
            self.config.host,
            self.config.port,
            [lambda server: add_worker_service(servicer, server)],
            [SERVICE_NAME],
            security=self.config.security,
            limits=self.config.rpc_limits,
            options=WORKER_OPTIONS,
        )
        host = dialled_name(self.config.advertise_host or self.config.host)
        self.ctx.port = self._server.port
        self.ctx.data_streams = self._server.limits.slots if self._server.limits else None
        self.ctx.address = f"{host}:{self.config.advertise_port or self._server.port}"
        if self.config.bulk:
            security = self.config.security
            self.ctx.bulk = BulkListener(
                self.config.host,
                self.config.bulk_port,
                self.config.bulk_limits,
                # Under TLS the bulk port is TLS too, with the gRPC port's credentials.
                tls=server_context(security.tls_cert, security.tls_key, security.tls_client_ca)
                if security.tls_cert is not None and security.tls_key is not None
                else None,
            )
            if self.config.call_lanes:
                self.ctx.bulk.serve_lanes(self._call_lanes(servicer))
        # This worker's rendezvous store: a generation's process groups meet in the
        # store of its rank 0, so they outlive any coordinator (see docs/engine.md).
        self._rendezvous, self._store_port = start_store(self.config.host, 0, _STORE_TIMEOUT_S)
        self._channel = self.config.coordinator_security.open_channel(
            self.config.coordinator, GRPC_OPTIONS
        )
        self._coordinator = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        if self._stop.is_set():  # stopped while starting: abort_start() saw no channel
            raise StoppedWhileStarting
        self._register(self.config.connect_timeout_s)
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self._watch_loop, name="watch", daemon=True).start()

    def _call_lanes(self, servicer: WorkerService) -> CallLanes:
        """The call lanes, whose calls run the gRPC server's handlers behind the same
        interceptors (the ticket stands for the token check)."""
        assert self._server is not None
        interceptors = lane_interceptors(self._server.interceptors)
        limits = self.config.bulk_limits
        served = self.config.lane_methods
        return CallLanes(
            lane_handlers(
                worker_handlers(servicer),
                interceptors,
                LANE_METHODS if served is None else served,
            ),
            limits.ticket_ttl_s,
            limits.idle_s,
        )

    def abort_start(self) -> None:
        """Ends a :meth:`start` running on another thread (a stop signal arrived while
        it still waited for the coordinator): its Register ends at once, and
        :meth:`start` raises (:class:`StoppedWhileStarting`, or the closed channel's
        error). Call :meth:`stop` once :meth:`start` has returned."""
        self._stop.set()
        channel = self._channel
        if channel is not None:
            channel.close()

    def stop(self) -> None:
        self._stop.set()
        self._beat_wake.set()
        if self._watch_call is not None:
            self._watch_call.cancel()
        try:
            if self.ctx.worker_id:
                self._coordinator.Leave(
                    coordinator_pb2.LeaveRequest(
                        worker_id=self.ctx.worker_id, lease_secret=self._lease_secret
                    ),
                    timeout=2.0,
                    metadata=worker_metadata(self.config.worker_token),
                )
        except grpc.RpcError:
            pass
        # Acting on a cluster message holds the lock (a generation connects to its
        # rendezvous store on its own thread, not under it): stopping waits for it
        # only briefly all the same, and the process ends its threads anyway.
        if self._lock.acquire(timeout=_STOP_WAIT_S):
            try:
                if self.runtime is not None:
                    self.runtime.stop()
                    self._set_runtime(None)
            finally:
                self._lock.release()
        else:
            log.warning("stopping while a generation is still being joined: not waiting for it")
        if self._server is not None:
            self._server.stop(_STOP_GRACE_S)
        if self.ctx.bulk is not None:
            self.ctx.bulk.close(_STOP_GRACE_S)
        if self._metrics is not None:
            self._metrics.stop()
        self._rendezvous = None  # the master store stops with its last reference
        self.ctx.uploads.close()
        self.ctx.shm_segments.close()
        if self._channel is not None:
            self._channel.close()

    def _drained(self) -> None:
        self.drained.set()
        self.on_drained()

    def drain_before_stop(self) -> None:
        """On SIGTERM: a member hands its rank and tensors to a live spare first
        (``--drain-timeout-s``; 0: not), so that stopping it loses nothing. While
        another worker's drain runs (a supervisor stopping several at once), it waits
        for that one to end and a spare to be live, then drains in turn. Without a
        spare, or when the drain fails, it stops anyway (the survivors re-form)."""
        timeout_s = self.config.drain_timeout_s
        cluster = self._cluster
        if timeout_s <= 0 or cluster is None or self.drained.is_set():
            return
        handoff = pending_handoff(cluster) or preparing_handoff(cluster)
        if handoff is not None and handoff.drained_id == self.worker_id:
            log.info("stopping: this worker is being drained already; waiting for it")
            self.drained.wait(timeout_s)
            return
        members = {w.worker_id for w in cluster.workers if w.rank >= 0}
        if self.worker_id not in members:
            return
        # Whether a spare is live is the coordinator's to say (this worker's view may
        # not show one that just registered): with none, Drain answers
        # FAILED_PRECONDITION and this worker leaves without a drain.
        log.info("stopping: draining this worker onto a spare first (at most %g s)", timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(deadline - time.monotonic(), 0.1)
            try:
                report = self._coordinator.Drain(
                    coordinator_pb2.DrainRequest(worker=self.worker_id, timeout_s=left),
                    timeout=left + self.ctx.op_timeout_s + 5.0,
                )
                break
            except grpc.RpcError as err:
                refused = err.code() == grpc.StatusCode.FAILED_PRECONDITION
                if not (refused and self._await_turn_to_drain(deadline)):
                    log.warning("the drain on stopping failed (%s); leaving", err.details())
                    return
        log.info(
            "drained onto %s: %d tensors, %d bytes in %.2f s",
            report.successor,
            report.tensors_moved,
            report.bytes_moved,
            report.seconds,
        )

    def _await_turn_to_drain(self, deadline: float) -> bool:
        """After a refused drain: whether another worker's drain was in progress (as the
        coordinator tells it now) and, by ``deadline``, it ended with a spare live
        again, so this worker may ask once more."""
        if time.monotonic() >= deadline:
            return False
        try:
            now = self._coordinator.GetCluster(
                coordinator_pb2.GetClusterRequest(),
                timeout=max(min(deadline - time.monotonic(), 5.0), 0.1),
                metadata=worker_metadata(self.config.worker_token),
            )
        except grpc.RpcError:
            return False
        handoff = pending_handoff(now) or preparing_handoff(now)
        if handoff is None or handoff.drained_id == self.worker_id:
            return False  # (refused for another reason: no spare, not a member...)
        log.info("stopping: the drain of %s runs; this worker's comes next", handoff.drained_id)

        def my_turn() -> bool:
            view = self._cluster
            if view is None or view.version < now.version:
                return False
            busy = pending_handoff(view) or preparing_handoff(view)
            spare = any(w.state == coordinator_pb2.WORKER_STATE_SPARE for w in view.workers)
            return busy is None and spare

        with self._views:
            return self._views.wait_for(my_turn, max(deadline - time.monotonic(), 0.0))

    @property
    def address(self) -> str:
        """The address peers and clients use ("" before it starts)."""
        return self.ctx.address

    @property
    def worker_id(self) -> str:
        """The id the coordinator gave this worker ("" before it registers)."""
        return self.ctx.worker_id

    def _set_runtime(self, runtime: Generation | None) -> None:
        """The caller holds ``_lock``."""
        self.runtime = self.ctx.runtime = runtime

    # --------------------------------------------------------- coordinator
    def _register(self, timeout_s: float) -> None:
        request = coordinator_pb2.RegisterRequest(
            address=self.address,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            devices=[str(d) for d in self.ctx.devices],
            backend=self.ctx.backend,
            version=collectives_server.__version__,
            last_generation=self._last_generation,
            store_port=self._store_port,
        )
        response = register(
            self._coordinator,
            request,
            timeout_s=timeout_s,
            token=self.config.worker_token,
            stop=self._stop,
        )
        with self._lock:
            self.ctx.worker_id = response.worker_id
            self._lease_secret = response.lease_secret
            self._heartbeat_s = response.heartbeat_interval_s or 1.0
            self._lease_s = response.lease_s or 5.0
            self._store_address = response.store_address
            if self.config.op_timeout_s is None and response.op_timeout_s:
                self.ctx.op_timeout_s = response.op_timeout_s
        log.info("registered as %s at %s", self.worker_id, self.address)
        # The first heartbeat at once: it opens the heartbeat stream, whose closing is how
        # the coordinator sees this process end (a crash is then seen without the lease).
        self._beat_wake.set()

    def _heartbeat_loop(self) -> None:
        while True:
            asleep = time.monotonic()
            self._beat_wake.wait(self._heartbeat_s)  # the interval, or less if the stream ended
            late = time.monotonic() - asleep - self._heartbeat_s
            if late > _HELD_UP_S:
                # This thread could not run: another held the interpreter (a long call
                # into C that keeps the GIL), or the host did not schedule the process.
                # Its generation's loop could not either: peers may have timed out on it.
                log.warning("this worker was held up for %.1f s (its heartbeat woke late)", late)
            self._beat_wake.clear()
            if self._stop.is_set():
                break
            self.ctx.models.expire_graphs()
            self.ctx.store.expire_uploads()
            self.ctx.shm_segments.reap()
            self.ctx.replaced.expire()
            runtime = self.runtime
            request = coordinator_pb2.HeartbeatRequest(
                worker_id=self.worker_id,
                lease_secret=self._lease_secret,
                joined_generation=self.joined_generation,
                busy=bool(runtime and runtime.busy),
                status=bounded_status(heartbeat_status(self.ctx)),
            )
            handoff_result = self._drain.result
            if handoff_result is not None:  # in every beat until the handoff has ended
                request.handoff_result.CopyFrom(handoff_result)
            else:
                request.handoff_bytes_copied = self._drain.bytes_copied
                request.prepared_generation, request.prepared_digest = self._drain.prepared
            try:
                self._send_heartbeat(request)
                self.ctx.stats.heartbeat(ok=True)
            except grpc.RpcError as err:
                self.ctx.stats.heartbeat(ok=False)
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("coordinator no longer knows this worker; registering again")
                    self._retire_runtime()
                    self._stream_retry_at = 0.0  # the new id gets a new stream at once
                    try:
                        self._register(timeout_s=max(self._heartbeat_s * 5, 5.0))
                    except grpc.RpcError as again:
                        log.warning("re-registration failed: %s", again.details())
                elif not self._stop.is_set():
                    log.debug("heartbeat failed: %s", err.details())
        if self._stream is not None:
            self._stream.close()

    def _heartbeat_timeout_s(self) -> float:
        return max(self._heartbeat_s * 2, 1.0)

    def _send_heartbeat(self, request: coordinator_pb2.HeartbeatRequest) -> None:
        """Sends one heartbeat on the stream, or as a unary call while no stream is up.

        A stream that failed for any reason but NOT_FOUND is dropped, this beat goes
        as a unary call, and a new stream is tried after _STREAM_RETRY_BEATS
        intervals (never again on a coordinator without HeartbeatStream).
        NOT_FOUND, from either path, is raised: the caller registers again.
        """
        stream = self._heartbeat_stream()
        if stream is not None:
            try:
                stream.send(request)
                return
            except grpc.RpcError as err:
                self._stream = None
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    raise
                retry_s = _STREAM_RETRY_BEATS * self._heartbeat_s
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    retry_s = float("inf")
                self._stream_retry_at = time.monotonic() + retry_s
                log.info(
                    "heartbeat stream failed (%s: %s); unary heartbeats for %g s",
                    err.code().name,
                    err.details(),
                    retry_s,
                )
                request.want_reply = False
        self._coordinator.Heartbeat(
            request,
            timeout=self._heartbeat_timeout_s(),
            metadata=worker_metadata(self.config.worker_token),
        )

    def _heartbeat_stream(self) -> HeartbeatStream | None:
        """The open heartbeat stream; opens one when none is and it is time to try."""
        if self._stream is None and time.monotonic() >= self._stream_retry_at:
            self._stream = HeartbeatStream(
                self._coordinator,
                reply_every_s=reply_interval_s(self._heartbeat_s),
                reply_timeout_s=self._heartbeat_timeout_s(),
                on_end=self._beat_wake.set,
                metadata=worker_metadata(self.config.worker_token),
            )
        return self._stream

    def _watch_loop(self) -> None:
        version = 0
        while not self._stop.is_set():
            try:
                call = self._coordinator.WatchCluster(
                    coordinator_pb2.WatchClusterRequest(after_version=version)
                )
                self._watch_call = call
                for cluster in call:
                    try:
                        self._on_cluster(cluster)
                    except Exception:
                        # (e.g. the rendezvous store's host died as its generation was
                        # sealed.) The watch goes on: re-opened from the last state acted
                        # on, it delivers the current one again, to be acted on anew.
                        log.exception(
                            "could not act on the cluster's version %d; trying again",
                            cluster.version,
                        )
                        call.cancel()
                        break
                    version = cluster.version
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                log.debug("cluster watch interrupted: %s", err.details())
            self._stop.wait(0.5)  # back off before re-opening the watch

    def _retire_runtime(self, superseded_by: int | None = None) -> None:
        with self._lock:
            if self.runtime is not None:
                # Its groups, for a next generation a drain carries over (carried_groups);
                # a gated one that never opened holds none of its own yet.
                if self.runtime.opened:
                    self._retired_groups = (self.runtime.generation, self.runtime.held_groups())
                self.runtime.stop(superseded_by)
                self._set_runtime(None)
            self.joined_generation = 0

    def _on_cluster(self, cluster: coordinator_pb2.Cluster) -> None:
        with self._lock:
            self._cluster = cluster
            self._views.notify_all()
            self.ctx.cluster_status = cluster.status or ("formed" if cluster.formed else "forming")
            members = [w for w in cluster.workers if w.rank >= 0]
            self.ctx.leader_address = next((w.address for w in members if w.rank == 0), "")
            me = next((w for w in members if w.worker_id == self.worker_id), None)
            if cluster.store_address:
                self._store_address = cluster.store_address
            current = self.runtime
            digest = cluster.membership_digest
            this_one = current is not None and (
                current.generation,
                current.membership_digest,
            ) == (cluster.generation, digest)
            handoff = pending_handoff(cluster)
            if handoff is not None:
                # Nobody takes a step in the generation before its handoff ends: ops
                # stop here. Its members form its groups meanwhile (gated), so that
                # the first step can follow the handoff at once.
                if not this_one:
                    self._retire_runtime(superseded_by=cluster.generation)
                    self._drain.take_part(handoff, current)
                    if me is not None and membership_refusal(cluster, members) is None:
                        self._set_runtime(
                            self._new_runtime(
                                cluster.generation, digest, me.rank, cluster.world_size, handoff
                            )
                        )
                return
            preparing = preparing_handoff(cluster)
            if preparing is not None:
                self._drain.prepare(preparing, cluster, self._connect_rendezvous, self.config.host)
            else:
                self._drain.settle(cluster)
            if self._drain.drained:
                self._retire_runtime()
                return
            if cluster.formed and me is not None:
                refusal = membership_refusal(cluster, members)
                if refusal is not None:
                    log.error("not joining generation %d: %s", cluster.generation, refusal)
                    if current is not None:
                        self._retire_runtime()
                    return
                if this_one:
                    assert current is not None
                    current.open()  # (gated until the handoff ended: the copy is installed)
                    return
                self._retire_runtime(superseded_by=cluster.generation)
                self._set_runtime(
                    self._new_runtime(cluster.generation, digest, me.rank, cluster.world_size)
                )
            elif current is not None:
                self._retire_runtime()

    def _new_runtime(
        self,
        generation: int,
        digest: str,
        rank: int,
        world_size: int,
        handoff: coordinator_pb2.Handoff | None = None,
    ) -> Generation:
        """The runtime of ``generation``; gated while ``handoff`` (the drain that sealed
        it) has not ended, and on the groups formed ahead when it sealed them so."""
        # Whether its members take groups formed ahead is the generation's record's to
        # say, not the handoff's: a worker may never see the message that sealed it.
        history = self._cluster.history if self._cluster is not None else ()
        record = next((r for r in history if r.generation == generation), None)
        ahead = None
        if record is not None and record.formed_ahead:
            key = AheadKey(generation, digest, rank, world_size, record.formed_ahead)
            ahead = self._drain.ahead.take(key)
            if ahead is None and self.ctx.device.type == "cpu":
                log.error("generation %d: sealed on groups formed ahead; none here", generation)
        else:
            self._drain.ahead.drop()
        spec = GenerationSpec(
            generation=generation,
            membership_digest=digest,
            rank=rank,
            world_size=world_size,
            # Connected by the generation's own thread: its host may be gone (a drain's
            # generation forms while a crash is still being noticed), and this daemon's
            # lock is not held meanwhile.
            tcp_store=functools.partial(self._connect_rendezvous, self._store_address),
            store=self.ctx.store,
            op_timeout_s=self.ctx.op_timeout_s,
            device=self.ctx.device,
            host=self.config.host,
            queue_size=self.config.queue_size,
            max_groups=self.config.max_groups,
            rebuild_after_s=self._lease_s + 2 * self._heartbeat_s,
            models=self.ctx.models,
            replaced=self.ctx.replaced,
            recorder=self.ctx.recorder,
            carried_groups=self._carried_groups(generation, handoff),
            gated=handoff is not None,
            formed_ahead=ahead,
        )
        hooks = GenerationHooks(
            on_joined=self._joined,
            on_op_done=self._op_done,
            on_data_collectives=self.ctx.stats.record_data_collectives,
            on_fused=self.ctx.stats.record_fused,
            on_straggler=self.ctx.stats.record_straggler,
            sync_models=lambda op_ctx: functools.partial(
                receive_models(op_ctx, self.ctx.uploads, self.ctx.built_ahead),
                self.ctx.handoff_gradients,
            ),
        )
        return Generation(spec, hooks).start()

    def _connect_rendezvous(self, address: str) -> dist.Store:
        """A client of the rendezvous store at ``address`` (a generation's rank 0 hosts
        the one its groups form through)."""
        host, port = address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=self.ctx.op_timeout_s)
        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)

    def _carried_groups(
        self, generation: int, handoff: coordinator_pb2.Handoff | None = None
    ) -> dict[int, tuple[int, ...]] | None:
        """For a generation a drain carried over (every rank of the cluster decides alike,
        from its history): the groups this worker held in the one before it, if only
        carried-over generations came between (else none); None when not carried over.
        While ``handoff`` (the drain that sealed it, onto a successor) runs, it counts as
        carried over: its first step waits for the handoff, which it follows only if
        the handoff completed (else another generation replaces it)."""
        history = {r.generation: r for r in self._cluster.history} if self._cluster else {}
        carried = {g for g, r in history.items() if r.carried_over}
        if handoff is not None and handoff.successor_id:
            carried.add(generation)
        if generation not in carried:
            return None
        held_in, groups = self._retired_groups
        between = range(held_in + 1, generation + 1)
        if not held_in or not all(g in carried for g in between):
            return {}
        return dict(groups)

    def _joined(self, generation: int) -> None:
        with self._lock:
            self._last_generation = max(self._last_generation, generation)
            if self.runtime is not None and self.runtime.generation == generation:
                self.joined_generation = generation
                # Tell the coordinator now, not at the next interval: the generation is
                # ready (collectives can run) once every member said it joined.
                self._beat_wake.set()

    def _op_done(
        self,
        desc: worker_pb2.OpDescriptor,
        outcome: OpResult | CollectiveError,
        latency_s: float,
    ) -> None:
        """Called on every rank after each op (every rank runs every op): counts and logs it."""
        op_done(self.ctx, desc, outcome, latency_s)

    # ---------------------------------------------------------------- state
    def state(self) -> worker_pb2.GetStateResponse:
        return worker_state(self.ctx)


def membership_refusal(
    cluster: coordinator_pb2.Cluster, members: list[coordinator_pb2.WorkerInfo]
) -> str | None:
    """Why a formed ``cluster`` must not be joined, or None: its members must hold
    ranks 0..world_size-1 once each, and its membership digest must be theirs."""
    ranks = sorted(w.rank for w in members)
    if ranks != list(range(cluster.world_size)):
        return f"its members hold ranks {ranks}, not 0..{cluster.world_size - 1}"
    ordered = [w.worker_id for w in sorted(members, key=lambda w: w.rank)]
    digest = membership_digest(ordered)
    if cluster.membership_digest != digest:
        return (
            f"its record names membership {cluster.membership_digest or '(none)'}, but its "
            f"members {ordered} have digest {digest}"
        )
    return None


def _start_unless_stopped(daemon: WorkerDaemon, stop: StopSignal) -> BaseException | None:
    """Runs ``daemon.start()`` on a helper thread while this (main) thread waits for
    it or a stop signal, which then ends the start at once (:meth:`WorkerDaemon.
    abort_start`): the start's Register waits for the coordinator up to
    ``--connect-timeout-s``, and a signal's handler only runs on the main thread.
    Returns what ``start()`` raised (None: started, or stopped while starting)."""
    outcome: list[BaseException | None] = []

    def starting() -> None:
        try:
            daemon.start()
            outcome.append(None)
        except BaseException as exc:  # handed to the main thread
            outcome.append(exc)
        finally:
            stop.wake()

    thread = threading.Thread(target=starting, name="start", daemon=True)
    thread.start()
    while not outcome and not stop.wait(None):
        pass
    if not outcome:  # stopped first
        daemon.abort_start()
        thread.join(_ABORT_START_WAIT_S)
        return None
    failed = outcome[0]
    if isinstance(failed, StoppedWhileStarting):
        return None
    if failed is not None and not isinstance(failed, (ValueError, OSError, grpc.RpcError)):
        raise failed
    return failed


def run_on_cpus(cpus: frozenset[int]) -> None:
    """Every thread of this process, and those it starts later, on ``cpus`` only; torch's
    intra-op threads as many as ``cpus`` unless ``OMP_NUM_THREADS`` chose."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(cpus))


def run_worker(config: WorkerConfig) -> int:
    """Runs a worker until SIGTERM/SIGINT, or until it was drained; prints its address
    as the first stdout line. On SIGTERM (a supervisor's stop) a member first drains
    itself onto a live spare (``--drain-timeout-s``); SIGINT stops it at once.

    Returns 1 if the worker cannot start; after a signal or a drain it exits the
    process with status 0 itself (see the comment at the end).
    """
    if config.cpus is not None:
        run_on_cpus(config.cpus)
    with StopSignal() as stop:
        try:
            daemon = WorkerDaemon(config)
        except (ValueError, OSError) as exc:
            log.error("worker failed to start: %s", exc)
            return 1
        daemon.on_drained = stop.wake
        failed = _start_unless_stopped(daemon, stop)
        if stop.stopping:
            # A supervisor stopping everything as it starts this worker (or before the
            # coordinator is up): the signal ends the start, never waits it out.
            log.info("signal %d while starting", stop.received or 0)
        elif failed is not None:
            detail = failed.details() if isinstance(failed, grpc.RpcError) else str(failed)
            log.error("worker failed to start: %s", detail)
            daemon.stop()
            return 1
        else:
            sys.stdout.write(f"{daemon.address}\n")
            sys.stdout.flush()
            heap.settle()
            while not stop.wait(None) and not daemon.drained.is_set():
                pass
            if stop.received == signal.SIGTERM:  # a supervisor's stop; SIGINT at once
                daemon.drain_before_stop()  # (further signals are ignored meanwhile)
    log.info("stopping worker %s", daemon.worker_id)
    daemon.stop()
    # A retired generation's thread may still be blocked inside gloo (which
    # cannot be interrupted); letting the interpreter finalize around it makes
    # C++ abort the process. Everything is flushed and closed: leave directly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
