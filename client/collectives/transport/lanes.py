"""Call lanes, client side: small unary calls over kept raw TCP connections.

A small forward, or a collective (whose request names tensors already on the
workers), costs more in gRPC's per-call work (HTTP/2 framing, the completion
queue, a thread hand-off on each side) than in the work itself. A call lane
carries the same request and response messages over a connection to the
worker's bulk port, framed by length (:mod:`collectives.wire.frames`),
one call at a time; a client keeps a few such connections per worker and
takes an idle one for each call, so concurrent calls of one client run on
separate lanes.

Each lane opens with a one-time ticket from ``GetDataPlane(open_lane=true)``,
a gRPC call (so the worker's token check applies once per lane), then runs
the worker's own gRPC handler for each call: answers, error codes, messages
and details are the gRPC call's. A failed call raises a ``grpc.RpcError``
(:class:`LaneError`) that :func:`collectives.errors.from_rpc_error` reads like
any other. What gRPC does on its own, the lane does by hand:

* the deadline travels with the request (the worker's handler sees it) and
  bounds the wait for the answer; once it passes the lane is closed and the
  call ends in ``DEADLINE_EXCEEDED``;
* a connection that breaks while a call waits ends it in ``UNAVAILABLE``, as
  a gRPC call whose worker went away; a call whose request could not be
  written (a lane the worker closed) takes gRPC instead;
* the client's ``close()`` ends the calls waiting on its lanes at once, as
  closing a channel cancels its calls (``CANCELLED``, "Channel closed!"), which
  :func:`~collectives.errors.from_rpc_error` reads as the handle closed.

A lane's socket is blocking, its timeout kept by the kernel and fitted to each
call's deadline (:mod:`collectives.wire.socket_timeouts`): a read or write is
one system call and one drop of the GIL, where Python's own timeout polls first.

Under TLS a lane is a TLS connection with the channel's credentials (the
worker's bulk port then speaks TLS, :mod:`collectives.wire.raw_tls`).

No lane (the worker has no bulk port: ``--no-bulk``, or one of the other kind,
TLS or plaintext, than this client's channel; or serves no lanes:
``--no-call-lanes``; or its bulk port refused the connection or the handshake):
the call takes gRPC, and the lane is not asked for again for a while.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Protocol

import grpc
from google.rpc import status_pb2

from collectives.errors import (
    CHANNEL_CLOSED_DETAILS,
    STATUS_DETAILS_METADATA_KEY,
    CollectiveError,
    status_code,
)
from collectives.transport.bulk import BulkPort, host_of, looks_open
from collectives.v1 import worker_pb2
from collectives.wire import socket_timeouts
from collectives.wire.frames import (
    ACK,
    FAILED,
    FAILED_CLOSING,
    FRAME_HEADER,
    LANE,
    LANE_REQUEST_HEADER,
    MAX_LANE_REQUEST_BYTES,
    OK,
    lane_method_ids,
    prelude,
)
from collectives.wire.limits import MAX_MESSAGE_BYTES
from collectives.wire.socket_timeouts import KernelTimeouts, peer_closed

__all__ = ["CallLanes", "LaneEndpoint", "LaneError", "PendingCall"]

# Idle lanes kept per worker, and for how long (the worker closes them after its
# bulk idle timeout, longer than this).
_MAX_IDLE = 16
_IDLE_KEEP_S = 20.0
# A lane idle less than this is reused without checking it is still open.
_FRESH_S = 1.0
# How long a lane's opening (ticket, connection, the worker's ACK) may take.
_OPEN_TIMEOUT_S = 5.0
# After a worker served no lane (none offered, refused, or broken at opening),
# its calls take gRPC this long before a lane is asked for again.
_SUSPEND_S = 30.0


class LaneEndpoint(Protocol):
    """What a lane needs of a worker's endpoint (the SDK's ``WorkerEndpoint``)."""

    @property
    def address(self) -> str: ...

    @property
    def stub(self) -> Any: ...

    @property
    def bulk(self) -> BulkPort: ...


class LaneError(grpc.RpcError):
    """A call on a lane that failed: the status a gRPC call would have ended with."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailing


class _Lane:
    """One lane: its connection, and the timeout the kernel keeps on it."""

    __slots__ = ("method_ids", "sock", "timeouts")

    def __init__(self, sock: socket.socket, method_ids: dict[str, int]) -> None:
        self.sock = sock
        # The methods this lane carries, by the ids its worker gave them.
        self.method_ids = method_ids
        self.timeouts = KernelTimeouts(sock, _OPEN_TIMEOUT_S)

    def fit(self, left: float) -> None:
        """Bounds the next reads and writes by ``left``, the call's time left, within
        a little of it (changing the kernel's timeout is a system call)."""
        self.timeouts.fit(left, 0.005 + 0.05 * left)

    def close(self) -> None:
        self.sock.close()

    def shut_down(self) -> None:
        """Ends the connection under a thread blocked reading it (that thread closes it)."""
        with contextlib.suppress(OSError):  # closed already
            # The TCP connection's, also under TLS (an SSLSocket's own shutdown
            # drops its TLS state under the reading thread).
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)


class CallLanes:
    """One client's call lanes to one worker: idle connections kept for reuse."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[float, _Lane]] = []  # (since, lane)
        self._busy: set[_Lane] = set()  # lanes a call was sent on, not yet answered
        self._suspended_until = 0.0
        self._closed = False
        # The methods the worker's latest lane carries (None: no lane opened yet): a
        # call of another takes gRPC without taking a lane.
        self._methods: frozenset[str] | None = None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (the client's ``close()``)."""
        return self._closed

    def send(
        self, endpoint: LaneEndpoint, method: str, request: bytes, timeout: float
    ) -> PendingCall | None:
        """Sends ``request`` to the Worker method ``method`` on a lane and returns the
        call, whose answer :meth:`PendingCall.result` waits for; None when no lane can
        carry it (nothing was sent: the caller makes the gRPC call), e.g. the worker's
        lanes do not carry ``method``. Sending to several workers first and then
        waiting puts their calls in flight together, from one thread.

        Raises:
            LaneError: ``DEADLINE_EXCEEDED``: ``timeout`` passed before it was sent.
        """
        if len(request) > MAX_LANE_REQUEST_BYTES:
            return None
        known = self._methods
        if known is not None and method not in known:
            return None
        deadline = time.monotonic() + timeout
        lane = self._take(endpoint, timeout)
        if lane is None:
            return None
        method_id = lane.method_ids.get(method)
        if method_id is None:
            self.keep(lane)
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            self.keep(lane)
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        with self._lock:
            closed = self._closed
            if not closed:
                self._busy.add(lane)  # close() can now end its wait
        if closed:
            lane.close()
            raise LaneError(grpc.StatusCode.CANCELLED, CHANNEL_CLOSED_DETAILS)
        try:
            lane.fit(left)
            lane.sock.sendall(LANE_REQUEST_HEADER.pack(method_id, len(request), left) + request)
        except OSError:  # a timeout too: the request may be cut short
            self.drop(lane)  # the worker never saw the call: it may take gRPC
            return None
        return PendingCall(self, lane, deadline)

    def close(self) -> None:
        """Closes the idle lanes and ends the calls waiting on the others: their
        connections are shut down, so a waiting read returns at once."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy, self._busy = list(self._busy), set()
        for _, lane in idle:
            lane.close()
        for lane in busy:
            lane.shut_down()  # the waiting thread closes it

    def _take(self, endpoint: LaneEndpoint, timeout: float) -> _Lane | None:
        now = time.monotonic()
        while True:
            with self._lock:
                if self._closed or now < self._suspended_until:
                    return None
                if not self._idle:
                    break
                since, lane = self._idle.pop()
            idle_s = now - since
            # A lane used a moment ago is taken as is (a worker closes idle lanes
            # only after a minute); one idle longer is first checked for the
            # worker's close, which a restart leaves behind.
            # (A fresh one is checked only for a close the worker already sent: a
            # stopping worker closes its lanes.)
            if idle_s < _FRESH_S and not peer_closed(lane.sock):
                return lane
            if _FRESH_S <= idle_s < _IDLE_KEEP_S and looks_open(lane.sock):
                return lane
            lane.close()
        opened = self._open(endpoint, min(timeout, _OPEN_TIMEOUT_S))
        with self._lock:
            if opened is None:
                self._suspended_until = time.monotonic() + _SUSPEND_S
                return None
            self._methods = frozenset(opened.method_ids)
        return opened

    def _open(self, endpoint: LaneEndpoint, timeout: float) -> _Lane | None:
        """A new lane to the worker, acknowledged; None when it has none to give."""
        if timeout <= 0:
            return None
        try:
            port = endpoint.bulk.port(endpoint, timeout)
        except CollectiveError:  # the worker did not answer: the gRPC call will say why
            return None
        if not port:
            return None
        try:
            answer = endpoint.stub.GetDataPlane(
                worker_pb2.DataPlaneRequest(open_lane=True), timeout=timeout
            )
        except (grpc.RpcError, ValueError):  # ValueError: a channel close() closed
            return None
        if not answer.lane_ticket or answer.bulk_port != port:
            return None
        try:
            sock = endpoint.bulk.dial(host_of(endpoint.address), port, timeout)
        except OSError:  # refused, or (TLS) the handshake failed
            endpoint.bulk.forget()
            return None
        try:
            sock.sendall(prelude(LANE, answer.lane_ticket))
            if sock.recv(1) != ACK:
                raise ConnectionResetError("the worker refused the lane")
        except OSError:
            sock.close()
            return None
        return _Lane(sock, lane_method_ids(list(answer.lane_methods)))

    def keep(self, lane: _Lane) -> None:
        """Keeps a lane whose call was answered, for the next call."""
        with self._lock:
            self._busy.discard(lane)
            if not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append((time.monotonic(), lane))
                return
        lane.close()

    def drop(self, lane: _Lane) -> None:
        """Closes a lane that cannot be reused (its call failed or was cut short)."""
        with self._lock:
            self._busy.discard(lane)
        lane.close()


class PendingCall:
    """A call sent on a lane, its answer not yet read."""

    def __init__(self, lanes: CallLanes, lane: _Lane, deadline: float) -> None:
        self._lanes = lanes
        self._lane = lane
        self._deadline = deadline

    def result(self) -> bytes:
        """The serialized response (the lane is then kept for the next call).

        Raises:
            LaneError: the call's status: the worker's, or ``DEADLINE_EXCEEDED``
                once the deadline passed, or ``UNAVAILABLE`` if the lane broke.
        """
        lane = self._lane
        try:
            header = _receive(lane, FRAME_HEADER.size, self._deadline)
            outcome, size = FRAME_HEADER.unpack(header)
            if outcome not in (OK, FAILED, FAILED_CLOSING) or size > MAX_MESSAGE_BYTES:
                raise ConnectionResetError("the worker sent a frame this client cannot read")
            body = _receive(lane, size, self._deadline)
        except TimeoutError:
            self._lanes.drop(lane)  # its answer may still come: this lane cannot be reused
            if self._lanes.closed:
                raise LaneError(grpc.StatusCode.CANCELLED, CHANNEL_CLOSED_DETAILS) from None
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as exc:
            self._lanes.drop(lane)
            if self._lanes.closed:  # close() shut it down under this call
                raise LaneError(grpc.StatusCode.CANCELLED, CHANNEL_CLOSED_DETAILS) from None
            raise LaneError(
                grpc.StatusCode.UNAVAILABLE,
                f"the call lane broke before the worker answered ({exc or 'closed'}): "
                "the worker stopped or restarted",
            ) from None
        if outcome == FAILED_CLOSING:
            self._lanes.drop(lane)
        else:
            self._lanes.keep(lane)
        if outcome == OK:
            return body
        status = status_pb2.Status.FromString(body)
        trailing = ((STATUS_DETAILS_METADATA_KEY, body),) if len(status.details) else ()
        raise LaneError(status_code(status.code), status.message, trailing)


def _receive(lane: _Lane, size: int, deadline: float) -> bytes:
    """``size`` bytes before ``deadline``.

    Raises:
        TimeoutError: the deadline passed first.
        ConnectionResetError: the connection closed first.
    """
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        lane.fit(left)  # bounds each read: within a little of the deadline
        try:
            n = socket_timeouts.recv_into(lane.sock, view[got:])
        except TimeoutError:  # stopped short of the deadline: the check above says
            continue
        if n == 0:
            raise ConnectionResetError("the worker closed the lane")
        got += n
    return bytes(buffer)
