"""A stopping worker closes its call lanes as gRPC closes a connection: a lane never
ends without telling its client whether the call on it ran.

A real bulk listener and lane server on loopback, a raw socket as the client
(framing of ``collectives.wire.frames``): the lane idle at the close gets a
closing frame that says ``UNAVAILABLE``, never run (``executed: no``); a call
running at the close is answered first, then the same frame; a call that arrives
once the worker is stopping is answered with that frame and never run.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import grpc
import pytest
from google.rpc import status_pb2

from collectives.errors import STATUS_DETAILS_METADATA_KEY, from_rpc_error, status_code
from collectives.transport.lanes import LaneError
from collectives.v1 import worker_pb2
from collectives.wire.frames import (
    ACK,
    FAILED_CLOSING,
    FRAME_HEADER,
    LANE,
    LANE_REQUEST_HEADER,
    OK,
    prelude,
)
from collectives_server.worker.data.limits import BulkLimits
from collectives_server.worker.transport.bulk import BulkListener
from collectives_server.worker.transport.lanes import CallLanes

pytestmark = pytest.mark.timeout(60)

METHOD = "Forward"


class _Handler:
    """A Forward handler that counts its runs and, while ``hold`` is clear, blocks."""

    def __init__(self) -> None:
        self.runs = 0
        self.entered = threading.Event()
        self.hold = threading.Event()
        self.hold.set()

    def __call__(self, payload: bytes, context) -> worker_pb2.ForwardResponse:
        # A lane hands a handler the request's bytes (the error boundary parses them).
        request = worker_pb2.ForwardRequest.FromString(payload)
        self.runs += 1
        self.entered.set()
        assert self.hold.wait(30)
        return worker_pb2.ForwardResponse(version=len(request.call_id))


@pytest.fixture
def served():
    handler = _Handler()
    method = grpc.unary_unary_rpc_method_handler(
        handler,
        response_serializer=worker_pb2.ForwardResponse.SerializeToString,
    )
    lanes = CallLanes({METHOD: method}, ticket_ttl_s=30, idle_s=30)
    listener = BulkListener("127.0.0.1", 0, BulkLimits())
    listener.serve_lanes(lanes)
    yield listener, lanes, handler
    handler.hold.set()
    with contextlib.suppress(OSError):
        listener.close(1.0)


def _lane(listener: BulkListener, lanes: CallLanes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
    sock.sendall(prelude(LANE, lanes.issue("test", ())))
    assert sock.recv(1) == ACK
    return sock


def _call(sock: socket.socket, lanes: CallLanes, call_id: str) -> None:
    body = worker_pb2.ForwardRequest(model="m", call_id=call_id).SerializeToString()
    method_id = lanes.methods.index(METHOD) + 1
    sock.sendall(LANE_REQUEST_HEADER.pack(method_id, len(body), 10.0) + body)


def _exactly(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, f"the lane closed after {len(got)} of {n} bytes, with no frame"
        got += chunk
    return got


def _frame(sock: socket.socket) -> tuple[int, bytes]:
    outcome, size = FRAME_HEADER.unpack(_exactly(sock, FRAME_HEADER.size))
    return outcome, _exactly(sock, size)


def _assert_closing_never_run(sock: socket.socket, frame: tuple[int, bytes] | None = None) -> None:
    outcome, body = frame or _frame(sock)
    assert outcome == FAILED_CLOSING
    status = status_pb2.Status.FromString(body)
    trailers = ((STATUS_DETAILS_METADATA_KEY, body),)
    err = from_rpc_error(LaneError(status_code(status.code), status.message, trailers))
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert err.executed is False, err.fields()
    assert "stopping" in err.message, err.message
    assert sock.recv(1) == b"", "the lane carried on after its closing frame"


def test_an_idle_lane_is_told_its_next_call_will_not_run(served) -> None:
    listener, lanes, handler = served
    sock = _lane(listener, lanes)
    _call(sock, lanes, "first")
    assert _frame(sock)[0] == OK
    listener.close(5.0)
    _assert_closing_never_run(sock)
    assert handler.runs == 1


def test_a_running_call_is_answered_before_the_lane_closes(served) -> None:
    listener, lanes, handler = served
    sock = _lane(listener, lanes)
    handler.hold.clear()
    _call(sock, lanes, "running")
    assert handler.entered.wait(10)
    closing = threading.Thread(target=listener.close, args=(10.0,))
    closing.start()
    handler.hold.set()
    outcome, body = _frame(sock)
    assert outcome == OK and worker_pb2.ForwardResponse.FromString(body).version == 7
    _assert_closing_never_run(sock)
    closing.join(10)
    assert not closing.is_alive() and handler.runs == 1


@pytest.mark.parametrize("round_", range(20))
def test_a_call_sent_as_the_worker_stops_ran_only_if_answered(served, round_) -> None:
    """The call races the close: answered (it ran, then the closing frame follows) or
    answered by the closing frame (it did not run); never a lane closed silently."""
    listener, lanes, handler = served
    sock = _lane(listener, lanes)
    _call(sock, lanes, "warm")
    assert _frame(sock)[0] == OK
    closing = threading.Thread(target=listener.close, args=(5.0,))
    closing.start()
    _call(sock, lanes, "late")
    closing.join(10)
    first = _frame(sock)
    if first[0] == OK:
        assert handler.runs == 2
        _assert_closing_never_run(sock)
    else:
        assert handler.runs == 1
        _assert_closing_never_run(sock, first)


def test_a_lane_opened_while_the_worker_stops_runs_nothing(served) -> None:
    listener, lanes, handler = served
    ticket = lanes.issue("test", ())
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
    lanes.close(1.0)  # the lane server stops first; the listener still accepts
    sock.sendall(prelude(LANE, ticket))
    first = sock.recv(1)
    if first == ACK:  # (accepted before the close) then the closing frame
        _assert_closing_never_run(sock)
    else:
        assert first in (b"", FRAME_HEADER.pack(FAILED_CLOSING, 0)[:1])
    assert handler.runs == 0
