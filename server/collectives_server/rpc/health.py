"""``grpc.health.v1`` without the library servicer's shutdown deadlock.

grpcio-health-checking's ``HealthServicer`` sends each watcher its status
while holding the servicer's lock, and a send on a synchronous server blocks
until gRPC's event thread has processed it. When a watcher is cancelled at that
moment, the event thread runs the watch's close callback, which waits for the
same lock: neither side moves, and ``enter_graceful_shutdown`` (hence
``ServerHandle.stop``) hangs for ever (seen in CI: a server stopped right after
its watchers were cancelled).

Here the lock only guards the table of statuses and watchers and is never held
across a send. A second lock, taken by the senders only (``set`` and ``Watch``,
never by gRPC's event thread), keeps each watcher's updates in the order they
were set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["HealthService"]

_Send = Callable[[health_pb2.HealthCheckResponse | None], None]
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthService(health_pb2_grpc.HealthServicer):
    """``Check`` and ``Watch`` of ``grpc.health.v1``; ``Watch`` holds no server thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._send_order = threading.Lock()
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._watchers: dict[str, set[_Send]] = {}
        self._shutting_down = False

    def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(  # noqa: N802 - gRPC method name
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.ServicerContext,
        send_response_callback: _Send | None = None,
    ) -> None:
        if send_response_callback is None:
            # Only a server without non-blocking streams calls us so; ours always has them.
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch needs a non-blocking server")
        send = send_response_callback
        service = request.service
        with self._send_order:
            with self._lock:
                status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                self._watchers.setdefault(service, set()).add(send)
            on_close = self._forget(service, send)
            if not context.add_callback(on_close):  # the call ended already
                on_close()
                return
            send(health_pb2.HealthCheckResponse(status=status))

    # grpc's server reads this attribute: the call returns at once and answers
    # later through ``send_response_callback``, so an idle watcher holds no thread.
    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]
    Watch.experimental_thread_pool = None  # type: ignore[attr-defined]

    def _forget(self, service: str, send: _Send) -> Callable[[], None]:
        def on_close() -> None:  # runs on gRPC's event thread: must not block
            with self._lock:
                self._watchers.get(service, set()).discard(send)
            send(None)

        return on_close

    def set(self, service: str, status: int) -> None:
        """Sets ``service``'s status and tells its watchers (ignored once shutting down)."""
        with self._send_order:
            with self._lock:
                if self._shutting_down:
                    return
                self._status[service] = status
                watchers = list(self._watchers.get(service, ()))
            self._tell(watchers, status)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good: later ``set`` calls are ignored."""
        with self._send_order:
            with self._lock:
                if self._shutting_down:
                    return
                self._shutting_down = True
                for service in self._status:
                    self._status[service] = _NOT_SERVING
                pending = [(list(self._watchers.get(s, ())), _NOT_SERVING) for s in self._status]
            for watchers, status in pending:
                self._tell(watchers, status)

    @staticmethod
    def _tell(watchers: list[_Send], status: int) -> None:
        # A watcher closed since the snapshot answers at once (its call is no longer active).
        for send in watchers:
            send(health_pb2.HealthCheckResponse(status=status))
