"""The connection behind a :class:`~collectives.Cluster`: the :class:`Session`.

A session is what every part of ``Cluster`` shares: the channel to the
coordinator and the membership view that follows it (``_membership``), a cached
channel per worker, call deadlines, the retry loop, the ordered op executor, the
parallel fan-out over ranks, and the connection's settings (shared memory,
progress bars). ``Session`` declares it as a ``Protocol``; ``ClusterSession``
implements it. The parts (``_data_plane``, ``_collectives``, ``_p2p``,
``_models``) each take a session in their constructor and use only its public
names; ``cluster.Cluster`` builds the session and the parts.

Retries follow one rule: retry only what is safe. Reads, ``put`` and ``delete``
are idempotent and are retried on ``UNAVAILABLE``; a collective is retried only
when the server marked it as never started (``executed is False``). Before each
retry the SDK asks the coordinator for the current cluster (a lost worker or a
new generation moves ranks and the leader), then waits for a membership change
or a short backoff, whichever comes first. Every retry stays inside the call's
one deadline.

Collectives of one session run on a single executor thread, so they reach the
leader in the order they were called, also with ``async_op=True`` (as ops on
one torch process group run in issue order).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

import grpc

from collectives import _progress
from collectives._validation import check_timeout
from collectives.addresses import (
    REFUSED_GRACE_S,
    not_a_coordinator,
    other_protocol,
    parse_addresses,
    refused_within,
)
from collectives.errors import (
    CollectiveError,
    DeadlineExceeded,
    InvalidArgument,
    Unavailable,
    annotate,
)
from collectives.session.membership_watch import Membership
from collectives.transport import shm
from collectives.transport.calls import Call, Done, Job, Start
from collectives.transport.endpoints import (
    ChannelPool,
    WorkerEndpoint,
    open_channel,
    wait_channel_ready,
)
from collectives.v1 import coordinator_pb2_grpc
from collectives.wire.cluster_state import ClusterNotFormed, ClusterSnapshot
from collectives.wire.security import ChannelSecurity
from collectives.work import IssuedOp, Work

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "OP_TIMEOUT_MARGIN_S",
    "REFRESH_TIMEOUT_S",
    "ClusterSession",
    "Session",
    "server_timeout_s",
]

log = logging.getLogger("collectives")

R = TypeVar("R")

DEFAULT_CONNECT_TIMEOUT_S = 30.0
# Default per-call timeout = the cluster's --op-timeout-s plus this margin, so the
# server's own timeout fires first and its message reaches the caller.
OP_TIMEOUT_MARGIN_S = 5.0
# Retry pacing: backoff doubles from MIN to MAX; at most MAX_ATTEMPTS tries per call.
RETRY_BACKOFF_MIN_S = 0.05
RETRY_BACKOFF_MAX_S = 1.0
MAX_ATTEMPTS = 10
# Bound on one GetCluster made to refresh the view between retries.
REFRESH_TIMEOUT_S = 5.0
# Share of a call's time it may spend waiting for a new generation's members to be ready.
READY_WAIT_FRACTION = 0.5
# Threads uploading/downloading to different workers in parallel.
IO_THREADS = 16
# Environment fallback of connect(shared_memory=...): "1" turns the fast path on.
SHM_ENV = "COLLECTIVES_SHM"


class Session(Protocol):
    """A connection to a cluster, as the parts of ``Cluster`` use it (see the module)."""

    @property
    def address(self) -> str:
        """The coordinator's ``host:port`` (or the comma-separated HA set)."""
        ...

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        ...

    @property
    def progress(self) -> bool | None:
        """The progress-bar setting (see ``collectives._progress``)."""
        ...

    @property
    def shared_memory(self) -> bool:
        """Whether ``put``/``get`` may use ``/dev/shm`` with same-host workers."""
        ...

    @property
    def shm_pool(self) -> shm.SegmentPool:
        """This connection's reusable shared-memory segments (closed with it)."""
        ...

    @property
    def default_timeout_s(self) -> float:
        """Timeout of a call made without ``timeout=``."""
        ...

    def snapshot(self) -> ClusterSnapshot:
        """The latest cluster view the watch delivered; no RPC."""
        ...

    def refresh(self, timeout: float | None = None) -> ClusterSnapshot:
        """Asks the coordinator for the cluster now (None: ``REFRESH_TIMEOUT_S``)."""
        ...

    def check_open(self) -> None:
        """Raises ``Unavailable`` when the connection is closed."""
        ...

    def deadline(self, timeout: float | None) -> float:
        """The absolute (monotonic) deadline of a call of ``timeout`` seconds."""
        ...

    @property
    def coordinator(self) -> coordinator_pb2_grpc.CoordinatorStub:
        """The coordinator's stub (its channel is this connection's)."""
        ...

    def formed_snapshot(self, deadline: float) -> ClusterSnapshot:
        """A formed snapshot, refreshed once if the latest says "not formed"."""
        ...

    def leader_snapshot(self, deadline: float) -> ClusterSnapshot:
        """A formed snapshot for sending an op to the leader, preferably a ready one."""
        ...

    def serving_snapshot(self, deadline: float, *, retains_graphs: bool = False) -> ClusterSnapshot:
        """A formed snapshot for calls to the members that need what they host (models):
        after a drain, one whose members have joined (the successor has the models);
        with ``retains_graphs`` (a forward with autograd), none while a drain runs."""
        ...

    def refresh_after_failure(self, deadline: float) -> None:
        """After a worker failed a call as gone: the coordinator's view now, and a wait
        (at most ``RETRY_BACKOFF_MAX_S``) for a newer one if it has not changed yet."""
        ...

    def endpoint(self, address: str) -> WorkerEndpoint:
        """The cached channel and stub of the worker at ``address``."""
        ...

    def retry(
        self,
        what: str,
        deadline: float,
        attempt: Callable[[float], R],
        retryable: Callable[[CollectiveError], bool],
    ) -> R:
        """Runs ``attempt(remaining_s)`` until it succeeds, fails for good, or time is up."""
        ...

    def ordered(
        self,
        what: str,
        fn: Callable[[], R],
        deadline: float,
        async_op: bool,
        record: IssuedOp | None = None,
    ) -> R | Work[R]:
        """Runs ``fn`` in this connection's op order: ``Work`` if ``async_op``, else its result."""
        ...

    def fan_out(self, what: str, starts: Mapping[int, Start[R]]) -> dict[int, R]:
        """Starts one call per rank, then returns their answers by rank."""
        ...


class ClusterSession:
    """The :class:`Session` of one ``Cluster``: connects in its constructor."""

    def __init__(
        self,
        address: str,
        timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        *,
        token: str | None = None,
        tls: bool | None = None,
        tls_ca: str | os.PathLike[str] | bytes | None = None,
        tls_cert: str | os.PathLike[str] | bytes | None = None,
        tls_key: str | os.PathLike[str] | bytes | None = None,
        shared_memory: bool | None = None,
        progress: bool | None = None,
        name: str | None = None,
    ) -> None:
        """Connects to the coordinator at ``address`` and waits for a formed generation.

        It returns once the generation is sealed and every member reports
        ``ready`` (joined its process group); if the members are still joining
        when ``timeout`` runs out it returns anyway with the formed cluster, and
        the first op waits for them.

        The keyword arguments (and their environment fallbacks, see
        :data:`collectives.wire.security.SETTINGS_PRECEDENCE`) secure every channel.

        ``name`` (else ``COLLECTIVES_CLIENT_NAME``) names this client to
        operators, in the user agent of every channel.

        Raises:
            InvalidArgument: ``address`` or ``timeout`` is malformed, a TLS or
                token setting is unreadable or inconsistent, or ``address`` is
                not a coordinator (a worker, an HTTP port: the message says which).
            PermissionDenied: the server refused the token (or its absence).
            Unavailable: nothing answers at ``address`` within ``timeout``, or
                what answers refuses until then (a coordinator of an HA set that
                cannot show that its view is current answers UNAVAILABLE, and
                another address of the set is asked).
            DeadlineExceeded: no generation was formed within ``timeout`` (the
                message quotes the coordinator's status).
        """
        parse_addresses(address)
        timeout = check_timeout(timeout, DEFAULT_CONNECT_TIMEOUT_S)
        try:
            security = ChannelSecurity.resolve(
                token=token, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
            )
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if shared_memory is None:
            shared_memory = os.environ.get(SHM_ENV, "").strip().lower() in ("1", "true", "yes")
        deadline = time.monotonic() + timeout
        # Opt-in same-host fast path for put/get (see collectives.transport.shm).
        self._shared_memory = bool(shared_memory)
        # Progress bars for large transfers (see collectives._progress): None on a TTY.
        self._progress = _progress.setting(progress)
        # Reused /dev/shm segments (tmpfs pages allocated once); unlinked by close().
        self._shm_pool = shm.SegmentPool()
        self._address = address.strip()
        self._closed = False
        self._channel = open_channel(self._address, security, name)
        self._coordinator = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._membership = Membership(self._channel, self._address)
        self._pool = ChannelPool(security, name)
        self._op_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="collectives-op"
        )
        # Ops of this client queued on or running in the op thread, or inline.
        self._ordered_lock = threading.Lock()
        self._ordered_pending = 0
        self._io_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=IO_THREADS, thread_name_prefix="collectives-io"
        )
        try:
            reason = refused_within(self._address, min(REFUSED_GRACE_S, timeout))
            if reason is not None:
                raise Unavailable(
                    f"nothing answers at {self._address}: {reason}. Is the coordinator "
                    "running? `collectives-server local` prints the address it listens on."
                )
            other = None if security.tls else other_protocol(self._address, min(1.0, timeout))
            if other is not None:
                raise InvalidArgument(other)
            wait_channel_ready(
                self._channel,
                self._address,
                _left(deadline),
                f"{timeout:g} s, the timeout given to connect()",
            )
            try:
                self._first_view(deadline)
            except CollectiveError as err:
                if err.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                what = not_a_coordinator(self._channel, self._address, _left(deadline))
                raise InvalidArgument(what) from None
            self._membership.start()
            if self._membership.wait_until(lambda s: s.formed, _left(deadline)) is None:
                snapshot = self._membership.snapshot
                raise DeadlineExceeded(
                    f"the cluster at {self._address} did not form within {timeout:.3g} s "
                    f"(generation {snapshot.generation}, {snapshot.world_size} members): "
                    f"{snapshot.status or 'no status from the coordinator'}"
                )
            # Formed means sealed; wait (within the same deadline) until every
            # member also joined the generation's process group, so what the
            # caller sees next (workers(), metrics, a first op) is "ready".
            self._membership.wait_until(lambda s: s.ready, _left(deadline))
        except BaseException:
            self.close()
            raise
        log.info("connected to %s: %s", self._address, self.describe())

    def _first_view(self, deadline: float) -> None:
        """The first ``GetCluster``. A coordinator answering UNAVAILABLE (it is stopping,
        or it cannot show that its view of an HA set is current) is asked again after a
        backoff, or another of the set is (see ``Membership.refresh``), until the deadline.

        Raises:
            CollectiveError: the last answer's error when the deadline passes.
        """
        backoff = RETRY_BACKOFF_MIN_S
        while True:
            try:
                self._membership.refresh(deadline - time.monotonic())
                return
            except Unavailable as err:
                if time.monotonic() + backoff >= deadline:
                    raise
                log.info("connecting to %s: %s; asking again", self._address, err)
            time.sleep(backoff)  # a retry's pause, inside connect()'s deadline
            backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)

    # --- state -------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def progress(self) -> bool | None:
        return self._progress

    @property
    def shared_memory(self) -> bool:
        return self._shared_memory

    @property
    def shm_pool(self) -> shm.SegmentPool:
        return self._shm_pool

    @property
    def default_timeout_s(self) -> float:
        return self._membership.snapshot.op_timeout_s + OP_TIMEOUT_MARGIN_S

    def snapshot(self) -> ClusterSnapshot:
        return self._membership.snapshot

    @property
    def coordinator(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return self._coordinator

    def refresh(self, timeout: float | None = None) -> ClusterSnapshot:
        self.check_open()
        return self._membership.refresh(check_timeout(timeout, REFRESH_TIMEOUT_S))

    def describe(self) -> str:
        """One line for logs and ``repr``: generation, world size, formed."""
        s = self._membership.snapshot
        return f"generation {s.generation}, world size {s.world_size}, formed={s.formed}"

    # --- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        """Stops watching the coordinator and closes every channel; idempotent.

        Pending ``async_op`` calls that have not started are cancelled.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._membership.close()
        self._op_executor.shutdown(wait=False, cancel_futures=True)
        self._io_executor.shutdown(wait=False, cancel_futures=True)
        self._pool.close()
        self._shm_pool.close()
        self._channel.close()

    # --- what the parts call ---------------------------------------------------------

    def check_open(self) -> None:
        if self._closed:
            raise Unavailable(f"the connection to {self._address} is closed")

    def deadline(self, timeout: float | None) -> float:
        """Absolute (monotonic) deadline of a call; validates ``timeout``."""
        return time.monotonic() + check_timeout(timeout, self.default_timeout_s)

    def formed_snapshot(self, deadline: float) -> ClusterSnapshot:
        """The latest snapshot, refreshed once if it says "not formed".

        Raises:
            ClusterNotFormed: the coordinator confirms the cluster is not formed.
        """
        self.check_open()
        snapshot = self._membership.snapshot
        if not snapshot.formed:
            try:
                snapshot = self._membership.refresh(min(_left(deadline), REFRESH_TIMEOUT_S))
            except CollectiveError as err:
                log.debug("refreshing the cluster of %s failed: %s", self._address, err)
            snapshot.require_formed()
        return snapshot

    def leader_snapshot(self, deadline: float) -> ClusterSnapshot:
        """A formed snapshot for sending a collective, preferably one whose members are ready.

        Right after a generation is sealed its members are still building their
        process groups; ops sent then fail or are refused. So wait (for at most
        half the time left) until the coordinator reports every member joined,
        then send whatever the view is. A generation sealed by a drain is the
        exception: its members admit ops while its groups form and run them once
        the handoff ends, so they are sent at once, to start as soon as it can.

        Raises:
            ClusterNotFormed: the coordinator confirms the cluster is not formed.
        """
        snapshot = self.formed_snapshot(deadline)
        if not snapshot.ready and not _sealed_by_drain(snapshot):
            self._membership.wait_until(lambda s: s.ready, READY_WAIT_FRACTION * _left(deadline))
            snapshot = self.formed_snapshot(deadline)
        return snapshot

    def serving_snapshot(self, deadline: float, *, retains_graphs: bool = False) -> ClusterSnapshot:
        """A formed snapshot whose members host what the cluster hosts.

        While a drain hands a rank over, and until the members have joined the
        generation it sealed, the successor holds the rank but not yet the models
        (it gets them from its peers as it joins). So then wait (for at most half
        the time left) until the drain has ended and the members are ready; other
        views are used as they are.

        A forward with autograd (``retains_graphs``) leaves its graph on the workers
        until its backward, and a graph cannot move with a drained rank: such a
        forward also waits while a drain prepares, so that the drained worker's
        graphs end (it waits for their backwards) and no new one is made there.
        """
        snapshot = self.formed_snapshot(deadline)
        draining = snapshot.drain is not None
        if (retains_graphs and draining) or (
            not snapshot.ready and (draining or _drained_into(snapshot))
        ):
            self._membership.wait_until(
                lambda s: s.ready and s.drain is None, READY_WAIT_FRACTION * _left(deadline)
            )
            snapshot = self.formed_snapshot(deadline)
        return snapshot

    def refresh_after_failure(self, deadline: float) -> None:
        version = self._membership.snapshot.version
        try:
            self._membership.refresh(min(_left(deadline), REFRESH_TIMEOUT_S))
        except CollectiveError as err:
            log.debug("refreshing the cluster of %s failed: %s", self._address, err)
        if self._membership.snapshot.version == version:
            self._membership.wait_for_change(version, min(RETRY_BACKOFF_MAX_S, _left(deadline)))

    def endpoint(self, address: str) -> WorkerEndpoint:
        return self._pool.endpoint(address)

    def retry(
        self,
        what: str,
        deadline: float,
        attempt: Callable[[float], R],
        retryable: Callable[[CollectiveError], bool],
    ) -> R:
        """Runs ``attempt(remaining_s)`` until it succeeds, fails for good, or time is up.

        Raises:
            CollectiveError: the last attempt's error (DeadlineExceeded when the
                deadline passed before an attempt could be made).
        """
        backoff = RETRY_BACKOFF_MIN_S
        for number in range(1, MAX_ATTEMPTS + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"{what}: the deadline passed before attempt {number}")
            version = self._membership.snapshot.version
            try:
                return attempt(remaining)
            except ClusterNotFormed:
                raise
            except CollectiveError as err:
                if number == MAX_ATTEMPTS or not retryable(err) or self._closed:
                    raise
                remaining = deadline - time.monotonic()
                if remaining <= backoff:
                    raise
                log.info("%s failed (%s); refreshing the cluster and retrying", what, err)
                try:
                    self._membership.refresh(min(remaining, REFRESH_TIMEOUT_S))
                except CollectiveError as refresh_err:
                    log.debug("refresh before retrying %s failed: %s", what, refresh_err)
                # Retry as soon as the membership changes, else after the backoff.
                self._membership.wait_for_change(version, min(backoff, _left(deadline)))
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)
                if deadline - time.monotonic() <= 0:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover - the loop always returns/raises

    def ordered(
        self,
        what: str,
        fn: Callable[[], R],
        deadline: float,
        async_op: bool,
        record: IssuedOp | None = None,
    ) -> R | Work[R]:
        """Runs ``fn`` on the single op thread: ``Work`` if ``async_op``, else its result.

        Raises:
            DeadlineExceeded: (sync) the op was still queued behind earlier ops at the deadline.
            CollectiveError: (sync) what ``fn`` raised.
        """
        self.check_open()
        if not async_op and self._enter_inline():
            # Nothing of this client's is queued or running: run it in the caller's
            # thread (two thread hand-offs less per small op), as the op thread would.
            try:
                return fn()
            finally:
                self._leave_ordered()
        with self._ordered_lock:
            self._ordered_pending += 1
        try:
            future = self._op_executor.submit(fn)
        except RuntimeError:  # shut down concurrently by close()
            self._leave_ordered()
            raise Unavailable(f"the connection to {self._address} is closed") from None
        future.add_done_callback(lambda _: self._leave_ordered())
        if async_op:
            return Work(future, what, record)
        try:
            return future.result(timeout=_left(deadline))
        except TimeoutError as exc:
            if future.done() and future.exception() is exc:
                raise
            if future.cancel():
                raise DeadlineExceeded(
                    f"{what}: still queued behind earlier async ops when the deadline passed"
                ) from None
            # Running: it is bounded by its own gRPC deadlines.
            return future.result()
        except concurrent.futures.CancelledError:
            raise Unavailable(f"{what} never ran: the cluster was closed first") from None

    def _enter_inline(self) -> bool:
        """True (and counted as running) when no op of this client is queued or running."""
        with self._ordered_lock:
            if self._ordered_pending:
                return False
            self._ordered_pending = 1
            return True

    def _leave_ordered(self) -> None:
        with self._ordered_lock:
            self._ordered_pending -= 1

    def fan_out(self, what: str, starts: Mapping[int, Start[R]]) -> dict[int, R]:
        """Starts each rank's call from this thread (``starts[rank]()`` sends it and
        returns the started :class:`~collectives.transport.calls.Call`), then waits for every
        answer, so the calls are in flight together. A :class:`~collectives.transport.calls.Job`
        (work that blocks, as a start or what a start returned) runs on the I/O pool,
        the last one on this thread. Waits for all, then raises the lowest rank's
        error.

        Raises:
            CollectiveError: some rank failed (the message names the rank).
        """
        self.check_open()
        calls: dict[int, Call[R]] = {}
        jobs: list[int] = []
        for rank, start in starts.items():
            calls[rank] = _started(what, rank, start)
            if isinstance(calls[rank], Job):
                jobs.append(rank)
        try:
            for rank in jobs[:-1]:
                job = calls[rank]
                assert isinstance(job, Job)
                calls[rank] = _PoolCall(self._io_executor.submit(job.fn))
        except RuntimeError:
            raise Unavailable(f"the connection to {self._address} is closed") from None
        if jobs:  # the last one runs on this thread now, while the others run
            calls[jobs[-1]] = _ran(calls[jobs[-1]])
        ended: dict[int, R] = {}
        failed: dict[int, BaseException] = {}
        for rank in starts:
            try:
                ended[rank] = _on_rank(what, rank, calls[rank].result)
            except Exception as exc:  # raised below, once the others ended
                failed[rank] = exc
        if failed:
            raise failed[min(failed)]
        return ended


class _PoolCall(Generic[R]):
    """A job running on the I/O pool."""

    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future[R]) -> None:
        self._future = future

    def result(self) -> R:
        return self._future.result()


def _ran(call: Call[R]) -> Done[R]:
    """``call`` awaited now: its answer or its error, kept for the fan-out to collect."""
    try:
        return Done(value=call.result())
    except Exception as exc:
        return Done(error=exc)


def _started(what: str, rank: int, start: Start[R]) -> Call[R]:
    """``start()``, a failure to start being the call's (annotated with the rank)."""
    try:
        return _on_rank(what, rank, start)
    except Exception as exc:
        return Done(error=exc)


def _on_rank(what: str, rank: int, fn: Callable[[], R]) -> R:
    """Calls ``fn``, prefixing a failure's message with the rank it concerns."""
    try:
        return fn()
    except CollectiveError as err:
        raise annotate(err, f"{what} on rank {rank}") from None


def without_models(snapshot: ClusterSnapshot) -> frozenset[str]:
    """The members (worker ids) that cannot serve the cluster's models in ``snapshot``:
    while a drain hands a rank over, its drained worker (its store closed) and the
    successor; once the handoff ended and until the members are ready, the successor
    of each drain into this generation (it gets the models as it joins). Empty in
    any other view (a drain that still prepares changes nothing yet)."""
    if snapshot.drain is not None:
        if snapshot.drain.preparing:
            return frozenset()
        return frozenset({snapshot.drain.worker_id, snapshot.drain.successor_id} - {""})
    if snapshot.ready or not _drained_into(snapshot):
        return frozenset()
    return frozenset(
        d.successor_id
        for d in snapshot.drains
        if d.generation_after == snapshot.generation and not d.error and d.successor_id
    )


def _sealed_by_drain(snapshot: ClusterSnapshot) -> bool:
    """Whether the current generation was sealed by a drain onto a spare, its handoff
    running or ended (its members form their groups beside the copy)."""
    drain = snapshot.drain
    if drain is not None and drain.generation_after == snapshot.generation:
        return bool(drain.successor_id)
    return _drained_into(snapshot)


def _drained_into(snapshot: ClusterSnapshot) -> bool:
    """Whether the current generation was sealed by a drain (its newest history record)."""
    return (
        bool(snapshot.history)
        and snapshot.history[-1].generation == snapshot.generation
        and (snapshot.history[-1].carried_over)
    )


def server_timeout_s(remaining_s: float) -> float:
    """The op timeout to ask the server for: a little less than the client's deadline."""
    return max(remaining_s - min(1.0, 0.1 * remaining_s), 0.001)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
