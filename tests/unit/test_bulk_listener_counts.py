"""The bulk listener counts what its caps decide: connections served and refused.

These counts are the worker's ``collectives_bulk_connections_open`` and
``collectives_bulk_connections_refused_total`` metrics.
"""

from __future__ import annotations

import contextlib
import socket

from helpers import wait_until

from collectives_server.worker.data.limits import BulkLimits
from collectives_server.worker.transport.bulk import BulkListener


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    return sock.recv(1) == b""


def test_served_and_refused_connections_are_counted_and_released() -> None:
    listener = BulkListener("127.0.0.1", 0, BulkLimits(max_connections_per_peer=2))
    socks: list[socket.socket] = []
    try:
        assert (listener.open_connections, listener.refused_connections) == (0, 0)
        socks = [socket.create_connection(("127.0.0.1", listener.port), 5) for _ in range(5)]
        wait_until(
            lambda: listener.open_connections + listener.refused_connections == 5,
            10,
            "the listener to accept or refuse all 5 connections",
        )
        assert (listener.open_connections, listener.refused_connections) == (2, 3)
        # The refused three were closed by the listener at once; the first two are served.
        assert [_closed_by_peer(s) for s in socks[2:]] == [True] * 3
        for s in socks[:2]:
            s.close()
        wait_until(lambda: listener.open_connections == 0, 10, "both served ones to close")
        assert listener.refused_connections == 3  # a counter: closing does not lower it
    finally:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        listener.close()
