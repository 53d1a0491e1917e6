"""A call cut short by the client's own close() is ``Unavailable``, never ``DeadlineExceeded``.

A real gRPC server on loopback whose handler holds the call until the test lets
it go: closing the channel while the call waits cancels it ("Channel closed!"),
and a call made on the closed channel is refused with a ``ValueError``; the
SDK's converter (``call_unary``) makes both ``Unavailable``. A lane's calls,
ended by ``CallLanes.close()``, read the same. Other cancellations keep their
meaning (a deadline).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import grpc
import pytest

from collectives.errors import (
    CHANNEL_CLOSED_DETAILS,
    DeadlineExceeded,
    Unavailable,
    from_rpc_error,
)
from collectives.transport.channels import call_unary
from collectives.transport.lanes import LaneError
from collectives.v1 import worker_pb2
from collectives_server.rpc import server as rpc

WAIT_S = 10.0


class _Held:
    """A handler that answers only once released; ``entered`` says a call arrived."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, request: object, context: grpc.ServicerContext) -> object:
        self.entered.set()
        self.release.wait(WAIT_S)
        return worker_pb2.GetStateResponse(worker_id="late")


@pytest.fixture
def held() -> Iterator[tuple[int, _Held]]:
    handler = _Held()

    def register(server: grpc.Server) -> None:
        method = grpc.unary_unary_rpc_method_handler(
            handler,
            worker_pb2.GetStateRequest.FromString,
            worker_pb2.GetStateResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("t.Held", {"Wait": method}),)
        )

    server = rpc.start_server("127.0.0.1", 0, [register], ["t.Held"], max_workers=2)
    yield server.port, handler
    handler.release.set()
    server.stop(0.5)


def _wait(channel: grpc.Channel):
    return channel.unary_unary(
        "/t.Held/Wait",
        request_serializer=worker_pb2.GetStateRequest.SerializeToString,
        response_deserializer=worker_pb2.GetStateResponse.FromString,
    )


def test_a_call_in_flight_when_its_channel_closes_is_unavailable(held) -> None:
    port, handler = held
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    method = _wait(channel)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            call_unary(method, worker_pb2.GetStateRequest(), WAIT_S, "Wait")
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert handler.entered.wait(WAIT_S), "the call never reached the server"
    channel.close()  # what Cluster.close() does to its channels
    caller.join(WAIT_S)
    assert not caller.is_alive()
    (err,) = raised
    assert isinstance(err, Unavailable) and not isinstance(err, TimeoutError), repr(err)
    assert err.message == (
        "Wait: the cluster handle was closed (close()) while the call was in flight"
    )
    # A call made on the closed channel: gRPC's ValueError, read the same way.
    with pytest.raises(Unavailable, match="the cluster handle was closed"):
        call_unary(method, worker_pb2.GetStateRequest(), WAIT_S, "Wait")


def test_a_lane_call_ended_by_close_reads_as_the_handle_closed() -> None:
    err = from_rpc_error(LaneError(grpc.StatusCode.CANCELLED, CHANNEL_CLOSED_DETAILS), "barrier")
    assert isinstance(err, Unavailable) and "cluster handle was closed" in err.message
    # Any other cancellation is what it was: the call's time ran out.
    other = from_rpc_error(LaneError(grpc.StatusCode.CANCELLED, "Cancelled"), "barrier")
    assert isinstance(other, DeadlineExceeded)


def test_a_call_to_an_address_where_nothing_listens_never_ran() -> None:
    """gRPC's own UNAVAILABLE for a connection refused (a stopped worker): the request
    never left this client, so the error says executed=False (and a retry is safe)."""
    free = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{free.getsockname()[1]}"
    free.close()  # nothing listens there now
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/collectives.v1.Worker/Forward")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"", timeout=WAIT_S)
    err = from_rpc_error(refused.value)
    assert isinstance(err, Unavailable) and err.executed is False, (err, err.fields())
    # Any other UNAVAILABLE without details of the server's says nothing of it.
    assert from_rpc_error(LaneError(grpc.StatusCode.UNAVAILABLE, "Socket closed")).executed is None
