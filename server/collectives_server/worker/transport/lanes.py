"""The worker's call lanes: small unary calls served over kept bulk-port connections.

A lane is a raw TCP connection to the worker's bulk port that opened with
a ``LANE`` prelude and a ticket from ``GetDataPlane(open_lane=true)`` (a gRPC call,
so the token check applies; framing in :mod:`collectives.wire.frames`).
The bulk listener hands such a connection to :meth:`CallLanes.serve`, which
answers its calls one at a time on the connection's own thread: no HTTP/2, no
completion queue, no hand-off to a pool.

A call on a lane runs the very handler the gRPC server runs for that method,
wrapped by the same server interceptors (the data-plane limits and the error
boundary; the ticket stands for the token check), with a :class:`LaneContext`
for its ``grpc.ServicerContext``: its deadline is the one the client sent, its
peer and metadata those of the ``GetDataPlane`` call that issued the ticket (so
the operator's view shows one client, not one per connection), and an abort
becomes a ``FAILED`` frame with the ``google.rpc.Status`` a gRPC call would end
with. The client's side is :mod:`collectives.transport.lanes`.

A worker that stops closes its lanes as gRPC closes its connections (a GOAWAY):
a lane between calls is sent one last ``FAILED_CLOSING`` frame, ``UNAVAILABLE``
marked never run (``executed: no``), which is the answer to whatever call its
client sends next or has just sent; a lane running a call answers it first
(within a grace period), then the same. So a lane the worker closed on purpose
never leaves a client guessing whether its call ran.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.rpc import status_pb2

from collectives.errors import STATUS_DETAILS_METADATA_KEY, Unavailable, to_grpc_status
from collectives.v1 import worker_pb2
from collectives.wire.frames import (
    ACK,
    FAILED,
    FAILED_CLOSING,
    FIRST_LANE_METHODS,
    FRAME_HEADER,
    LANE_REQUEST_HEADER,
    MAX_LANE_METHODS,
    MAX_LANE_REQUEST_BYTES,
    OK,
    TOKEN_BYTES,
    new_token,
)
from collectives.wire.limits import MAX_MESSAGE_BYTES
from collectives.wire.socket_timeouts import KernelTimeouts, peer_closed
from collectives_server.security import TokenAuthInterceptor

__all__ = [
    "LANE_METHODS",
    "CallLanes",
    "LaneContext",
    "LaneTicket",
    "lane_handlers",
    "lane_interceptors",
]

log = logging.getLogger(__name__)

# Tickets issued and not yet presented, at most this many (the oldest go first).
_MAX_PENDING_TICKETS = 4096
# A request's payload is read at most this much at a time, so memory follows the
# bytes that arrived, not the length a header claims.
_READ_BYTES = 256 * 1024
# A frame's deadline is kept by the kernel's socket timeout, changed only when it
# is off by more than this (each change is a system call): a frame may overrun its
# deadline by this much.
_SLACK_S = 0.05
# An answer ready after its call's deadline is still offered this long (a client
# whose deadline passed during the send is reading it; any other has gone).
_ANSWER_GRACE_S = 1.0
# SO_LINGER on, 0 s: closing the socket resets the connection, discarding unsent bytes.
_RESET_AT_CLOSE = struct.pack("ii", 1, 0)

Metadata = tuple[tuple[str, Any], ...]

_SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

# The Worker methods this release's lanes carry, in id order (from 1): the first
# lane release's, whose ids a client of that release sends without reading the
# names, then those added since. Each is a unary call whose request is small
# (tensors travel by name, or inline up to a budget).
LANE_METHODS: tuple[str, ...] = (
    *FIRST_LANE_METHODS,
    "Exchange",
    "NewGroup",
    "DestroyGroup",
    "DeleteTensor",
    "SetModelMode",
    "ZeroGrad",
    "Step",
    "AllReduceGradients",
    "TrainStep",
)
assert len(LANE_METHODS) <= MAX_LANE_METHODS


class _OpenLane:
    """One lane being served: whether it runs a call, and whether it was told to go.
    Only its own thread writes to it (a cancel aside, while a call runs)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.running = False
        self.gone = False  # the closing frame was sent (or the lane ended)


def _goaway_frame() -> bytes:
    status = to_grpc_status(
        Unavailable(
            "the worker is stopping: this call was not run; retry it (on the rank's "
            "current holder)",
            executed=False,
        )
    )
    (details,) = [v for k, v in status.trailing_metadata if k == STATUS_DETAILS_METADATA_KEY]
    return _frame(FAILED_CLOSING, details)


@dataclass(frozen=True)
class LaneTicket:
    """Who asked for a lane: the ``GetDataPlane`` call's peer and metadata, and until when."""

    peer: str
    metadata: Metadata
    expires: float


def lane_interceptors(
    server_interceptors: Iterable[grpc.ServerInterceptor],
) -> list[grpc.ServerInterceptor]:
    """What a lane call passes through: the gRPC server's own interceptors, in its
    order, but the token check (a lane's ticket came from a call that passed it), so
    an interceptor added to the server guards lanes too."""
    return [i for i in server_interceptors if not isinstance(i, TokenAuthInterceptor)]


def lane_handlers(
    handlers: Mapping[str, grpc.RpcMethodHandler],
    interceptors: Sequence[grpc.ServerInterceptor],
    served: Iterable[str] = LANE_METHODS,
) -> dict[str, grpc.RpcMethodHandler]:
    """The handler of each method of ``served`` (a subset of :data:`LANE_METHODS`):
    the Worker service's handler of that name (``handlers``, as the gRPC server
    registers them) behind ``interceptors`` (outermost first), as the gRPC server
    wraps it for a call of that method.

    Raises:
        ValueError: a method of ``served`` is not one a lane carries.
    """
    lane = {}
    for name in served:
        if name not in LANE_METHODS or name not in handlers:
            raise ValueError(
                f"{name!r} is not a method a call lane carries (one of {', '.join(LANE_METHODS)})"
            )
        base = handlers[name]
        method = f"/{_SERVICE_NAME}/{name}"

        def innermost(_details: grpc.HandlerCallDetails, base=base):
            return base

        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None]
        continuation = innermost
        for interceptor in reversed(interceptors):
            continuation = _intercepted(interceptor, continuation)
        handler = continuation(_CallDetails(method, ()))
        if handler is None or handler.unary_unary is None:
            raise ValueError(f"{method}: the interceptors left no unary handler")
        lane[name] = handler
    return lane


def _intercepted(interceptor: grpc.ServerInterceptor, continuation):
    def call(details: grpc.HandlerCallDetails):
        return interceptor.intercept_service(continuation, details)

    return call


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: Metadata) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class LaneContext:
    """The :class:`~collectives_server.rpc.call_context.CallContext` of one call on a
    lane (what a gRPC call's ``ServicerContext`` offers the same code)."""

    def __init__(
        self,
        ticket: LaneTicket,
        timeout_s: float,
        cancel: Callable[[], None],
        conn: socket.socket | None = None,
    ) -> None:
        self._ticket = ticket
        self._conn = conn  # the lane: a client that left closed it
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        self._cancel = cancel
        self._callbacks: list[Callable[[], None]] = []
        self.cancelled = False
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._trailers: Metadata = ()

    # -- what handlers and interceptors read
    def peer(self) -> str:
        return self._ticket.peer

    def invocation_metadata(self) -> Metadata:
        return self._ticket.metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def is_active(self) -> bool:
        """False once cancelled, past the client's deadline, or the client left: a
        client cancels a lane call by closing the lane (its ``close()``, or its
        deadline passing), which a peek at the connection sees without reading."""
        if self.cancelled or (self._deadline is not None and time.monotonic() >= self._deadline):
            return False
        if self._conn is not None and peer_closed(self._conn):
            self.cancelled = True
            return False
        return True

    def cancel(self) -> None:
        """Ends the call now (the data-plane watchdog's bound): the client is told
        CANCELLED and the connection closes; the handler's answer is dropped."""
        self.cancelled = True
        self._cancel()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._callbacks.append(callback)
        return True

    def run_callbacks(self) -> None:
        for callback in self._callbacks:
            with contextlib.suppress(Exception):
                callback()

    # -- what handlers set
    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self.code, self.details = code, details
        # A bare Exception, as grpc's own abort raises: the error boundary and the
        # guards know it (rpc.errors.is_abort) and let it pass.
        raise Exception()

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self._trailers = tuple(status.trailing_metadata or ())
        self.abort(status.code, status.details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, trailing_metadata: Metadata) -> None:
        self._trailers = tuple(trailing_metadata)

    def status(self) -> status_pb2.Status:
        """The call's failure as a ``google.rpc.Status``: code, message, and the
        details a gRPC call would carry in its trailers."""
        code = self.code or grpc.StatusCode.UNKNOWN
        status = status_pb2.Status(code=code.value[0], message=self.details)
        for key, value in self._trailers:
            if key == STATUS_DETAILS_METADATA_KEY and isinstance(value, bytes):
                with contextlib.suppress(Exception):
                    carried = status_pb2.Status.FromString(value)
                    status.details.extend(carried.details)
        return status


class CallLanes:
    """Issues lane tickets and serves the calls of the connections that present them."""

    def __init__(
        self, handlers: Mapping[str, grpc.RpcMethodHandler], ticket_ttl_s: float, idle_s: float
    ) -> None:
        # Ids are positions in LANE_METHODS (from 1), the same whichever are served:
        # a method not served is named "" in a ticket's answer, its id unused.
        self.methods = tuple(name if name in handlers else "" for name in LANE_METHODS)
        self._handlers = {
            i: (name, handlers[name]) for i, name in enumerate(self.methods, start=1) if name
        }
        self._ticket_ttl_s = ticket_ttl_s
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._tickets: OrderedDict[bytes, LaneTicket] = OrderedDict()
        # Calls answered on lanes, by method (counters).
        self.calls: Counter[str] = Counter()
        self._open: set[_OpenLane] = set()
        self._closing = False
        self._idle = threading.Condition(self._lock)  # notified as each lane ends

    def issue(self, peer: str, metadata: Iterable[tuple[str, Any]]) -> bytes:
        """A one-time ticket for one lane connection of the caller ``peer``."""
        ticket = new_token()
        now = time.monotonic()
        kept = tuple((k, v) for k, v in metadata if k != "authorization")
        with self._lock:
            self._expire_locked(now)
            while len(self._tickets) >= _MAX_PENDING_TICKETS:
                self._tickets.popitem(last=False)
            self._tickets[ticket] = LaneTicket(peer, kept, now + self._ticket_ttl_s)
        return ticket

    def claim(self, ticket: bytes) -> LaneTicket | None:
        """The lane ``ticket`` opens (spent now), or None: unknown, spent or expired."""
        if len(ticket) != TOKEN_BYTES:
            return None
        with self._lock:
            self._expire_locked(time.monotonic())
            return self._tickets.pop(ticket, None)

    def _expire_locked(self, now: float) -> None:
        while self._tickets:
            ticket, issued = next(iter(self._tickets.items()))
            if issued.expires >= now:
                return
            del self._tickets[ticket]

    def serve(self, conn: socket.socket, ticket: LaneTicket) -> None:
        """Acknowledges the lane, then answers its calls until it closes or idles out."""
        lane = _OpenLane(conn)
        with self._lock:
            closing = self._closing
            if not closing:
                self._open.add(lane)
        try:
            if closing:
                _go_away(lane)
                return
            self._serve(conn, ticket, lane)
        except OSError:
            pass
        except Exception:  # a bug of ours: this lane closes, the worker goes on
            log.exception("call lane from %s failed", ticket.peer)
        finally:
            if self._closing:  # woken by close(), or about to run a call: not run
                with lane.lock:
                    _go_away(lane)
            with self._lock:
                self._open.discard(lane)
                self._idle.notify_all()

    def close(self, grace_s: float) -> None:
        """Closes every lane as the worker stops: the idle ones at once, each with a
        frame that says its next call was not run; the ones running a call once it
        is answered, waiting for them up to ``grace_s``."""
        with self._lock:
            self._closing = True
            lanes = list(self._open)
        for lane in lanes:
            with lane.lock:
                if not lane.running:
                    # Wakes its thread from its read (a TLS lane's state is only ever
                    # touched by its own thread): that thread sends the closing frame.
                    with contextlib.suppress(OSError):
                        socket.socket.shutdown(lane.conn, socket.SHUT_RD)
        deadline = time.monotonic() + grace_s
        with self._lock:
            self._idle.wait_for(lambda: not self._open, max(0.0, deadline - time.monotonic()))

    def _start_call(self, lane: _OpenLane) -> bool:
        """Marks ``lane`` as running the call just read; False (and the closing frame
        sent, the call not run) once the worker is stopping."""
        with lane.lock:
            if self._closing:
                return False  # serve() sends the closing frame
            lane.running = True
            return True

    def _end_call(self, lane: _OpenLane) -> bool:
        """The call was answered; False (after the closing frame) once the worker is stopping."""
        with lane.lock:
            lane.running = False
            return not self._closing  # else serve() sends the closing frame

    def _serve(self, conn: socket.socket, ticket: LaneTicket, lane: _OpenLane) -> None:
        # Blocking, with the bounds kept by the kernel: one system call (and one drop
        # of the GIL) per read and write (``collectives.wire.socket_timeouts``).
        timeouts = KernelTimeouts(conn, self._idle_s)
        conn.sendall(ACK)
        header = bytearray(LANE_REQUEST_HEADER.size)
        while True:
            # Between calls a lane may idle ``idle_s``. From a frame's first byte, the
            # whole frame must arrive within ``idle_s``: a deadline that a client
            # dripping a byte at a time cannot push back.
            timeouts.fit(self._idle_s, _SLACK_S)
            if not _recv_into(conn, memoryview(header)[:1]):
                return
            deadline = time.monotonic() + self._idle_s
            if not _recv_until(conn, timeouts, memoryview(header)[1:], deadline):
                return
            method_id, size, timeout_s = LANE_REQUEST_HEADER.unpack(header)
            method, handler = self._handlers.get(method_id, ("", None))
            if handler is None or size > MAX_LANE_REQUEST_BYTES:
                why = (
                    f"the call lane carries no method {method_id}"
                    if handler is None
                    else f"a lane request of {size} bytes is over {MAX_LANE_REQUEST_BYTES}"
                )
                code = (
                    grpc.StatusCode.UNIMPLEMENTED
                    if handler is None
                    else grpc.StatusCode.RESOURCE_EXHAUSTED
                )
                _send_closing(conn, status_pb2.Status(code=code.value[0], message=why))
                return  # the payload is not read: the connection cannot go on
            payload = _recv_payload(conn, timeouts, size, deadline)
            if payload is None or not self._start_call(lane):
                return
            try:
                answered = self._answer(conn, timeouts, method, handler, payload, ticket, timeout_s)
            except BaseException:
                lane.gone = True  # it closes without a closing frame
                raise
            if not answered:
                lane.gone = True  # cancelled or not taken: closed already
                return
            if not self._end_call(lane):
                return

    def _answer(
        self,
        conn: socket.socket,
        timeouts: KernelTimeouts,
        method: str,
        handler: grpc.RpcMethodHandler,
        payload: bytes,
        ticket: LaneTicket,
        timeout_s: float,
    ) -> bool:
        """Runs one call and sends its answer; False when the connection must close.

        The answer obeys gRPC's bound on a message (over it, the client gets the
        ``RESOURCE_EXHAUSTED`` a gRPC call would end with), and must be taken by the
        client within the call's deadline (``idle_s`` for a call without one; at
        least ``_ANSWER_GRACE_S`` after it is ready): a client that does not read it
        loses it and the lane, and the worker keeps nothing for it."""
        sent = threading.Lock()
        answered = False

        def cancel() -> None:
            nonlocal answered
            with sent:
                if answered:
                    return
                answered = True
                status = status_pb2.Status(
                    code=grpc.StatusCode.CANCELLED.value[0],
                    message="the worker cancelled the call (a data-plane bound)",
                )
                with contextlib.suppress(OSError):
                    _send_closing(conn, status)
                with contextlib.suppress(OSError):
                    # The TCP connection's, also under TLS (an SSLSocket's own
                    # shutdown drops its TLS state under the lane's thread).
                    socket.socket.shutdown(conn, socket.SHUT_RDWR)

        context = LaneContext(ticket, timeout_s, cancel, conn)
        try:
            response = handler.unary_unary(payload, context)
            body = handler.response_serializer(response)
            if len(body) > MAX_MESSAGE_BYTES:
                context.code = grpc.StatusCode.RESOURCE_EXHAUSTED
                context.details = (
                    f"Sent message larger than max ({len(body)} vs. {MAX_MESSAGE_BYTES})"
                )
                frame = _frame(FAILED, context.status().SerializeToString())
            else:
                frame = _frame(OK, body)
            del response, body
        except Exception:
            if context.code is None:  # not an abort: the error boundary let it through
                context.code, context.details = grpc.StatusCode.INTERNAL, "internal error"
            frame = _frame(FAILED, context.status().SerializeToString())
        finally:
            context.run_callbacks()
        with sent:
            if answered:
                return False
            answered = True  # from here a cancel finds the call answered: it waits for nothing
            with self._lock:
                self.calls[method] += 1
        left = context.time_remaining()
        taken_by = time.monotonic() + max(self._idle_s if left is None else left, _ANSWER_GRACE_S)
        if _send_until(conn, timeouts, frame, taken_by):
            return True
        # Not taken in time: drop what the kernel still holds of it too (a reset at
        # close, not a FIN queued behind megabytes nobody reads).
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_AT_CLOSE)
        return False


def _frame(outcome: int, body: bytes) -> bytes:
    return FRAME_HEADER.pack(outcome, len(body)) + body


# The closing frame of a stopping worker (see the module doc).
_GOAWAY = _goaway_frame()


def _go_away(lane: _OpenLane) -> None:
    """Sends ``lane`` its closing frame (once; from its own thread, with its lock) and
    ends its side. Bytes of a call that arrived meanwhile are read first (never run):
    a socket closed with unread bytes resets the connection, and a reset may cost the
    client the frame it has not read yet."""
    if lane.gone:
        return
    lane.gone = True
    conn = lane.conn
    if not isinstance(conn, ssl.SSLSocket):
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            while conn.recv(_READ_BYTES):
                pass
    with contextlib.suppress(OSError):
        conn.settimeout(_ANSWER_GRACE_S)
        conn.sendall(_GOAWAY)
    with contextlib.suppress(OSError):
        # The TCP connection's, also under TLS (as in a cancel).
        socket.socket.shutdown(conn, socket.SHUT_WR)


def _send_closing(conn: socket.socket, status: status_pb2.Status) -> None:
    """Sends a failure after which this lane closes."""
    conn.sendall(_frame(FAILED_CLOSING, status.SerializeToString()))


def _move_by(
    timeouts: KernelTimeouts, deadline: float, total: int, step: Callable[[int], int]
) -> bool:
    """Calls ``step(done)`` (one read or write, returning the bytes it moved; 0 at
    EOF) until ``total`` bytes moved by ``deadline``, each call's wait bounded by
    the kernel to the time left; False on EOF, a reset, or the deadline passing."""
    done = 0
    try:
        while done < total:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            timeouts.fit(left, _SLACK_S)
            moved = step(done)
            if moved == 0:
                return False
            done += moved
    except OSError:
        return False
    return True


def _recv_until(
    conn: socket.socket, timeouts: KernelTimeouts, view: memoryview, deadline: float
) -> bool:
    """Fills ``view`` by ``deadline``; False on EOF, a reset, or the deadline passing."""
    return _move_by(timeouts, deadline, view.nbytes, lambda done: conn.recv_into(view[done:]))


def _recv_payload(
    conn: socket.socket, timeouts: KernelTimeouts, size: int, deadline: float
) -> bytes | None:
    """``size`` bytes by ``deadline`` (None: EOF, a reset, or the deadline passed),
    held in memory only as they arrive: a header promising megabytes reserves
    nothing."""
    parts: list[bytes] = []

    def read(done: int) -> int:
        parts.append(conn.recv(min(size - done, _READ_BYTES)))
        return len(parts[-1])

    if not _move_by(timeouts, deadline, size, read):
        return None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _send_until(
    conn: socket.socket, timeouts: KernelTimeouts, frame: bytes, deadline: float
) -> bool:
    """Sends ``frame`` by ``deadline``; False when it could not (the connection is
    then unusable: part of the frame may have gone)."""
    view = memoryview(frame)
    return _move_by(timeouts, deadline, len(view), lambda done: conn.send(view[done:]))


def _recv_into(conn: socket.socket, view: memoryview) -> bool:
    """Fills ``view``; False on EOF, a reset, or no byte within the socket's timeout."""
    got = 0
    try:
        while got < view.nbytes:
            n = conn.recv_into(view[got:])
            if n == 0:
                return False
            got += n
    except OSError:
        return False
    return True
