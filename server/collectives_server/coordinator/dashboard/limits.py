"""A ``ThreadingHTTPServer`` that bounds its connections (a flood of idle sockets cannot pin it).

The standard server starts one thread per connection and keeps it for as long as
the peer keeps the connection open, so idle connections used to hold coordinator
threads forever. :class:`BoundedHTTPServer` caps how many connections are served
at once (beyond: a short 503, written by the accepting thread, and the socket is
closed) and listens with a backlog of 1024; the handler's ``timeout`` (the
dashboard's ``idle_s``) closes connections that send nothing, or do not read, for
that long.
"""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Any

__all__ = ["BACKLOG", "BoundedHTTPServer", "BoundedIPv6Server"]

BACKLOG = 1024

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 31\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
    b"too many dashboard connections\n"
)


class BoundedHTTPServer(ThreadingHTTPServer):
    request_queue_size = BACKLOG
    daemon_threads = True

    def __init__(self, address: Any, handler: Any, *, max_connections: int = 256) -> None:
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._count_lock = threading.Lock()
        self._open = 0
        self.refused_connections = 0
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        with self._count_lock:
            return self._open

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with self._count_lock:
                self.refused_connections += 1
            try:
                request.settimeout(0.05)  # never let one refusal stall the accept loop
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._count_lock:
            self._open += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._count_lock:
            self._open -= 1
        self._slots.release()


class BoundedIPv6Server(BoundedHTTPServer):
    address_family = socket.AF_INET6
