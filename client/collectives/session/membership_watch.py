"""Follows the coordinator's ``WatchCluster`` stream in a background thread.

The SDK needs the current generation, world size and leader for every call,
and must not pay a ``GetCluster`` round trip for each. So one daemon thread
keeps a :class:`~collectives.wire.cluster_state.ClusterSnapshot` current: it opens
``WatchCluster(after_version=<last version seen>)``, replaces the snapshot on
every message, and re-opens the stream when it ends or fails, backing off
(1/10 s doubling to 2 s, waiting on the stop event so ``close()`` is immediate).
Streams carry a deadline like every other call and are re-opened when it
expires, which also bounds how long a silently dead connection goes unnoticed.

Callers that just saw a failure (a worker lost, a generation changed) call
:meth:`Membership.refresh` for an authoritative ``GetCluster`` answer rather than
waiting for the stream. Snapshots only move forward: one of an older generation,
or of the same generation at an older ``version``, is dropped
(:meth:`ClusterSnapshot.older_than`), so a slow ``GetCluster`` racing the stream
cannot roll the view back, and neither can a coordinator of an HA set that
answers with an older view than another one did. Given several coordinator
addresses, the channel spreads calls over them; an older answer, or an
UNAVAILABLE (a coordinator that cannot show that its view is current), sends
``refresh`` on to the next coordinator, and an older message on the watch stream
re-opens the stream (on the next coordinator).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from collectives.errors import Unavailable
from collectives.transport.channels import call_unary
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives.wire.cluster_state import ClusterSnapshot
from collectives.wire.targets import split_addresses

__all__ = ["Membership"]

log = logging.getLogger(__name__)

# Each WatchCluster stream is re-opened after this long (a planned deadline).
WATCH_STREAM_S = 60.0
WATCH_BACKOFF_MIN_S = 0.1
WATCH_BACKOFF_MAX_S = 2.0


class Membership:
    """The latest cluster snapshot, kept current by a WatchCluster follower thread."""

    def __init__(self, channel: grpc.Channel, address: str) -> None:
        self.address = address
        # GetCluster tries at most this many coordinators (the channel spreads calls over them).
        self._coordinators = max(1, len(split_addresses(address)))
        self._stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self._cond = threading.Condition()
        self._snapshot: ClusterSnapshot | None = None
        self._stop = threading.Event()
        self._call: grpc.RpcContext | None = None
        self._thread = threading.Thread(
            target=self._follow, name=f"collectives-watch-{address}", daemon=True
        )

    # --- reading -----------------------------------------------------------

    @property
    def snapshot(self) -> ClusterSnapshot:
        """The latest snapshot.

        Raises:
            Unavailable: no snapshot was received yet.
        """
        with self._cond:
            if self._snapshot is None:
                raise Unavailable(f"no cluster state received from {self.address} yet")
            return self._snapshot

    def refresh(self, timeout: float) -> ClusterSnapshot:
        """Asks the coordinator (``GetCluster``) and returns the newest snapshot known.

        With several coordinator addresses, an answer older than the newest
        snapshot seen is not taken and neither is an UNAVAILABLE: the call goes on
        to the next coordinator, each at most once within ``timeout``.

        Raises:
            CollectiveError: no coordinator answered within ``timeout`` (the last
                one's error).
        """
        deadline = time.monotonic() + timeout
        for attempt in range(1, self._coordinators + 1):
            try:
                msg = call_unary(
                    self._stub.GetCluster,
                    coordinator_pb2.GetClusterRequest(),
                    deadline - time.monotonic(),
                    f"GetCluster from {self.address}",
                )
            except Unavailable as err:
                if attempt == self._coordinators or time.monotonic() >= deadline:
                    raise
                log.debug("%s; asking the next coordinator", err)
                continue
            answer = ClusterSnapshot.from_proto(msg)
            if self._offer(answer) or time.monotonic() >= deadline:
                break
            log.info(
                "GetCluster from %s answered generation %d (version %d), older than the "
                "view already seen; asking the next coordinator",
                self.address,
                answer.generation,
                answer.version,
            )
        return self.snapshot

    def wait_until(
        self, predicate: Callable[[ClusterSnapshot], bool], timeout: float
    ) -> ClusterSnapshot | None:
        """Waits up to ``timeout`` s for a snapshot satisfying ``predicate``; None if none came."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self._stop.is_set()
                    or (self._snapshot is not None and predicate(self._snapshot))
                ),
                timeout=max(timeout, 0.0),
            )
            if ok and self._snapshot is not None and predicate(self._snapshot):
                return self._snapshot
            return None

    def wait_for_change(self, after_version: int, timeout: float) -> None:
        """Returns when a snapshot newer than ``after_version`` arrives, or after ``timeout`` s."""
        self.wait_until(lambda s: s.version > after_version, timeout)

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Starts the follower thread (call after the first :meth:`refresh`)."""
        self._thread.start()

    def close(self, join_timeout_s: float = 2.0) -> None:
        """Stops the follower thread and cancels its stream; idempotent."""
        self._stop.set()
        with self._cond:
            call, self._call = self._call, None
            self._cond.notify_all()
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)

    # --- internals -----------------------------------------------------------

    def _offer(self, snapshot: ClusterSnapshot) -> bool:
        """Takes ``snapshot`` unless it is older than the current one; whether it did."""
        with self._cond:
            current = self._snapshot
            if current is not None and snapshot.older_than(current):
                return False
            if current is None or snapshot.generation != current.generation:
                log.info(
                    "cluster %s: generation %d, world size %d, formed=%s (%s)",
                    self.address,
                    snapshot.generation,
                    snapshot.world_size,
                    snapshot.formed,
                    snapshot.status,
                )
            self._snapshot = snapshot
            self._cond.notify_all()
            return True

    def _version(self) -> int:
        with self._cond:
            return self._snapshot.version if self._snapshot is not None else 0

    def _follow(self) -> None:
        backoff = WATCH_BACKOFF_MIN_S
        while not self._stop.is_set():
            request = coordinator_pb2.WatchClusterRequest(after_version=self._version())
            call = self._stub.WatchCluster(request, timeout=WATCH_STREAM_S)
            with self._cond:
                if self._stop.is_set():
                    call.cancel()
                    return
                self._call = call
            try:
                failed = False  # the server ended the stream; re-open after a pause
                for msg in call:
                    answer = ClusterSnapshot.from_proto(msg)
                    if self._offer(answer):
                        backoff = WATCH_BACKOFF_MIN_S
                    elif self._coordinators > 1:
                        log.info(
                            "WatchCluster on %s sent generation %d (version %d), older than "
                            "the view already seen; watching the next coordinator",
                            self.address,
                            answer.generation,
                            answer.version,
                        )
                        call.cancel()
                        failed = True
                        break
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the planned end of a stream: re-open at once
                log.debug("WatchCluster on %s failed: %s", self.address, err.code())
                failed = True
            except Exception:  # a malformed message must not kill the follower
                log.exception("WatchCluster on %s: unexpected error", self.address)
                call.cancel()
                failed = True
            finally:
                with self._cond:
                    self._call = None
            if failed:
                log.debug("re-opening WatchCluster on %s in %.2f s", self.address, backoff)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)
