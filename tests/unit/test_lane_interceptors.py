"""A lane call is a call like a gRPC one to the code that serves it.

The worker builds its lanes' handler chains from the list its gRPC server was
started with (``ServerHandle.interceptors``), so an interceptor added to the
server guards lane calls too, in the same order; only the token check is left
out, a lane's ticket having come from a call that passed it. And a lane call's
context reads as a gRPC call's does when the client went away or its deadline
passed.
"""

from __future__ import annotations

import socket

import grpc

from collectives_server.rpc.errors import ErrorBoundary
from collectives_server.rpc.limits import DataPlaneLimits, RpcLimits
from collectives_server.rpc.server import start_server
from collectives_server.security import ServerSecurity, TokenAuthInterceptor
from collectives_server.worker.rpc.guards import departure
from collectives_server.worker.transport.lanes import (
    LaneContext,
    LaneTicket,
    lane_handlers,
    lane_interceptors,
)


def test_lanes_take_the_servers_interceptors_but_the_token_check() -> None:
    handle = start_server(
        "127.0.0.1",
        0,
        register=[],
        service_names=[],
        security=ServerSecurity(token="lane-interceptor-token"),
        limits=RpcLimits(),
    )
    try:
        kinds = [type(i) for i in handle.interceptors]
        assert kinds == [TokenAuthInterceptor, DataPlaneLimits, ErrorBoundary]
        assert [type(i) for i in lane_interceptors(handle.interceptors)] == kinds[1:]
    finally:
        handle.stop(0.1)


class _Recording(grpc.ServerInterceptor):
    """Records the methods it saw, and wraps the handler so its calls are counted."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        log, name = self.log, self.name

        def counted(request, context):
            log.append(f"{name}:{handler_call_details.method}")
            return handler.unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            counted,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def test_every_interceptor_wraps_each_lane_method_outermost_first() -> None:
    log: list[str] = []
    handlers = {
        "Forward": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "AllReduce": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
    }
    interceptors = [_Recording("outer", log), _Recording("inner", log)]
    lane = lane_handlers(handlers, lane_interceptors(interceptors), ("Forward", "AllReduce"))
    assert lane["Forward"].unary_unary(b"x", None) == b"x"
    lane["AllReduce"].unary_unary(b"y", None)
    assert log == [
        "outer:/collectives.v1.Worker/Forward",
        "inner:/collectives.v1.Worker/Forward",
        "outer:/collectives.v1.Worker/AllReduce",
        "inner:/collectives.v1.Worker/AllReduce",
    ]


def _context(conn: socket.socket, timeout_s: float = 30.0) -> LaneContext:
    ticket = LaneTicket(peer="ipv4:127.0.0.1:5000", metadata=(), expires=0.0)
    return LaneContext(ticket, timeout_s, cancel=lambda: None, conn=conn)


def test_a_client_that_closes_its_lane_ends_the_call_for_the_handler() -> None:
    """A client cancels a lane call by closing the lane (its close(), or its deadline
    passing): the handler's context then reads as a gRPC call's does once the
    client cancelled, and the guards count the client's departure."""
    worker_end, client_end = socket.socketpair()
    try:
        context = _context(worker_end)
        assert context.is_active() and departure(context) is None
        client_end.close()
        assert not context.is_active()
        gone = departure(context)
        assert gone is not None and gone.code == grpc.StatusCode.CANCELLED
    finally:
        worker_end.close()


def test_bytes_from_a_live_client_are_left_for_the_next_frame() -> None:
    worker_end, client_end = socket.socketpair()
    try:
        context = _context(worker_end)
        client_end.sendall(b"next")
        assert context.is_active()
        assert worker_end.recv(4) == b"next"
    finally:
        worker_end.close()
        client_end.close()


def test_a_lane_call_past_its_deadline_is_over() -> None:
    worker_end, client_end = socket.socketpair()
    try:
        context = _context(worker_end, timeout_s=1e-9)
        assert not context.is_active()
        gone = departure(context)
        assert gone is not None and gone.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        worker_end.close()
        client_end.close()
