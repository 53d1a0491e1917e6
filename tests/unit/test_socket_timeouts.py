"""Timeouts kept by the kernel (``collectives.wire.socket_timeouts``), on real sockets.

A read with nothing to read and a write the peer never drains each end in
``TimeoutError`` once the kernel's timeout passes, on a socket Python sees as
blocking (no poll before each call); bytes that arrive are read as ever; the
timeout is set on the socket itself (read back with ``getsockopt``), lowered
only when asked for one shorter by more than the slack, and never zero (which
the kernel reads as "wait forever").
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest

from collectives.wire import socket_timeouts
from collectives.wire.socket_timeouts import KernelTimeouts


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    listener.close()
    yield client, server
    client.close()
    server.close()


def _kernel_timeout(sock: socket.socket, option: int) -> float:
    seconds, micros = struct.unpack("@ll", sock.getsockopt(socket.SOL_SOCKET, option, 16))
    return seconds + micros / 1e6


def test_the_timeouts_are_the_kernels_and_the_socket_is_blocking(pair) -> None:
    client, _ = pair
    timeouts = KernelTimeouts(client, 2.5)
    assert client.gettimeout() is None  # no poll before each read or write
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        assert _kernel_timeout(client, option) == pytest.approx(2.5, abs=0.01)
    timeouts.at_most(2.45, slack=0.1)  # shorter by less than the slack: kept
    assert timeouts.seconds == 2.5
    timeouts.at_most(1.0, slack=0.1)
    assert timeouts.seconds == 1.0
    assert _kernel_timeout(client, socket.SO_RCVTIMEO) == pytest.approx(1.0, abs=0.01)
    timeouts.fit(1.02, slack=0.05)  # within the slack either way: kept
    assert timeouts.seconds == 1.0
    timeouts.fit(3.0, slack=0.05)  # a longer deadline raises it
    assert _kernel_timeout(client, socket.SO_SNDTIMEO) == pytest.approx(3.0, abs=0.01)
    timeouts.set(0.0)  # never "forever": the shortest the kernel is given
    assert 0 < _kernel_timeout(client, socket.SO_RCVTIMEO) <= 0.01


def test_a_read_with_nothing_to_read_times_out_and_bytes_that_came_are_read(pair) -> None:
    client, server = pair
    KernelTimeouts(client, 0.2)
    buffer = bytearray(8)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        socket_timeouts.recv_into(client, memoryview(buffer))
    waited = time.monotonic() - started
    assert 0.15 <= waited < 5.0, waited
    server.sendall(b"12345678")
    got = 0
    deadline = time.monotonic() + 5.0
    while got < 8 and time.monotonic() < deadline:
        got += socket_timeouts.recv_into(client, memoryview(buffer)[got:])
    assert bytes(buffer) == b"12345678"


def test_a_write_the_peer_never_drains_times_out(pair) -> None:
    client, server = pair
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    KernelTimeouts(client, 0.2)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        socket_timeouts.sendall(client, b"x" * (32 * 1024 * 1024))  # far past both buffers
    assert time.monotonic() - started < 10.0
