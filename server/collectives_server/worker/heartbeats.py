"""The worker's end of ``Coordinator.HeartbeatStream``: one open stream, one request per beat.

Workers heartbeat on a stream rather than with unary ``Heartbeat`` calls because a
message on an open stream costs the coordinator a fraction of a call (see the
coordinator's ``service`` module). The coordinator answers only the requests that set
``want_reply``, because an answer costs it about as much as the request: so
:class:`HeartbeatStream` asks for one on its first beat (the coordinator knows the
worker, the stream works) and then only when its last answer is older than
``reply_every_s`` (see :func:`reply_interval_s`), and treats an answer that does
not come within ``reply_timeout_s`` as a broken stream (a coordinator that hangs,
or a connection that died without a reset). Anything else that ends the stream
(NOT_FOUND for an unknown worker, a reset connection, the coordinator going away)
arrives as the call's status at once and wakes the worker (``on_end``).

The worker daemon uses :class:`HeartbeatStream`; the coordinator benchmark
(``bench/row_coordinator.py``) drives the same RPC with the same
:class:`ReplySchedule` from grpc.aio, so it loads the coordinator as workers do.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc

__all__ = [
    "REPLY_EVERY_BEATS",
    "HeartbeatStream",
    "HeartbeatStreamError",
    "ReplySchedule",
    "reply_interval_s",
]

_END = object()  # put in the request queue: half-close the stream

# A worker asks for an answer on the first beat of a stream, then one beat in this many.
REPLY_EVERY_BEATS = 30


def reply_interval_s(heartbeat_s: float) -> float:
    """How often a worker asks the coordinator to answer a heartbeat on its stream.

    An answer costs the coordinator about as much as the heartbeat itself (a send,
    and more thread hand-offs in grpcio's synchronous server), so asking every beat
    would nearly double its CPU, and asking every few beats (enough to notice a dead
    stream within a lease) would still add much of it. One beat in
    :data:`REPLY_EVERY_BEATS` adds little. Errors that
    arrive as the stream's status (NOT_FOUND, a reset connection, a coordinator
    shutting down) are noticed at once whatever this interval; only a stream that
    goes silent (a hung coordinator, a connection dropped without a reset) waits
    for it: up to this interval plus the reply timeout.
    """
    return REPLY_EVERY_BEATS * heartbeat_s


class ReplySchedule:
    """Which beats on a stream ask for an answer, and when an answer is overdue.

    Not thread-safe. Shared by :class:`HeartbeatStream` and the benchmark's
    simulated workers, so both put the same load on the coordinator.
    """

    def __init__(self, every_s: float, timeout_s: float) -> None:
        self.every_s = every_s
        self.timeout_s = timeout_s
        self._replied_at = float("-inf")
        self._asked_at: float | None = None  # the unanswered want_reply request, if any

    def ask(self, now: float) -> bool:
        """Whether the beat sent at ``now`` sets ``want_reply`` (and records the ask)."""
        if self._asked_at is None and now - self._replied_at >= self.every_s:
            self._asked_at = now
            return True
        return False

    def replied(self, now: float) -> None:
        self._replied_at = now
        self._asked_at = None

    def overdue(self, now: float) -> bool:
        """True once an asked-for answer is more than ``timeout_s`` late."""
        return self._asked_at is not None and now - self._asked_at > self.timeout_s


class HeartbeatStreamError(grpc.RpcError):
    """A stream that ended or stopped answering, with a status like a failed call's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class HeartbeatStream:
    """One open ``HeartbeatStream`` call, fed by :meth:`send` once per heartbeat.

    gRPC sends the queued requests from its own thread; a reader thread takes the
    answers and the final status, and calls ``on_end`` (from that thread) when the
    stream ends, so a worker can act on NOT_FOUND without waiting for its next beat.
    (grpcio wakes a thread blocked on a response stream every 0.1 s: nothing for one
    worker, but the reason the benchmark drives its thousand streams with grpc.aio.)
    """

    def __init__(
        self,
        stub: coordinator_pb2_grpc.CoordinatorStub,
        *,
        reply_every_s: float,
        reply_timeout_s: float,
        on_end: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._schedule = ReplySchedule(reply_every_s, reply_timeout_s)
        self._on_end = on_end
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._error: grpc.RpcError | None = None
        self.last_reply: coordinator_pb2.HeartbeatResponse | None = None
        self._call = stub.HeartbeatStream(iter(self._requests.get, _END), metadata=metadata or None)
        self._reader = threading.Thread(target=self._read, name="heartbeat-replies", daemon=True)
        self._reader.start()

    def send(self, request: coordinator_pb2.HeartbeatRequest) -> None:
        """Queues one heartbeat (setting its ``want_reply`` when an answer is due).

        Raises :class:`grpc.RpcError` instead when the stream has ended (the
        coordinator's status: NOT_FOUND means register again) or an answer is
        overdue (DEADLINE_EXCEEDED; the stream is cancelled). Either way the
        stream is finished: open a new one.
        """
        now = self._clock()
        with self._lock:
            error = self._error or self._overdue(now)
            if error is None and self._schedule.ask(now):
                request.want_reply = True
        if error is not None:
            self.cancel()
            raise error
        self._requests.put(request)

    def close(self) -> None:
        """Half-closes the stream: the coordinator ends it once the queued beats are in."""
        self._requests.put(_END)

    def cancel(self) -> None:
        """Abandons the stream at once."""
        self._call.cancel()
        self._requests.put(_END)  # releases gRPC's thread waiting for the next request

    def _overdue(self, now: float) -> grpc.RpcError | None:
        if not self._schedule.overdue(now):
            return None
        return HeartbeatStreamError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the coordinator did not answer a heartbeat within {self._schedule.timeout_s:g} s",
        )

    def _read(self) -> None:
        error: grpc.RpcError
        try:
            for reply in self._call:
                with self._lock:
                    self._schedule.replied(self._clock())
                    self.last_reply = reply
            error = HeartbeatStreamError(
                grpc.StatusCode.UNAVAILABLE, "the coordinator ended the heartbeat stream"
            )
        except grpc.RpcError as exc:
            error = exc
        with self._lock:
            self._error = error
        self._requests.put(_END)
        if self._on_end is not None:
            self._on_end()
