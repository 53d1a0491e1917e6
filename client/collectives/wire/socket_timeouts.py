"""Timeouts kept by the kernel on a blocking socket (``SO_RCVTIMEO``, ``SO_SNDTIMEO``).

A socket with Python's own timeout (``settimeout``) polls before every read and
write: two system calls, and the GIL dropped and taken back twice. On the
sockets that carry every small call (call lanes, the engine's control channel)
taking the GIL back is a wait behind whichever thread took it meanwhile, and on
a busy worker those waits add up on the path of every op. A blocking socket
whose timeouts the kernel keeps does one system call per read or write; one
that times out fails with ``EAGAIN``, which :func:`recv_into` and
:func:`sendall` raise as :class:`TimeoutError`, as Python's own timeout does.

:class:`KernelTimeouts` owns a socket's two timeouts (both always equal) and
changes them only when asked for a different value: setting them is a system
call.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct

__all__ = ["TIMED_OUT", "KernelTimeouts", "peer_closed", "recv_into", "sendall"]

# The kernel reads 0 as "never": the shortest timeout it is given is this.
_SHORTEST_S = 1e-3


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, _SHORTEST_S)
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))


class KernelTimeouts:
    """The read and write timeout of ``sock``, kept by the kernel; ``sock`` is made
    blocking (Python's own timeout off) and starts with ``seconds``."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        sock.settimeout(None)
        self._sock = sock
        self.seconds = -1.0
        self.set(seconds)

    def set(self, seconds: float) -> None:
        """Every later read and write of the socket waits at most ``seconds`` (at
        least a millisecond)."""
        if seconds == self.seconds:
            return
        value = _timeval(seconds)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self.seconds = seconds

    def at_most(self, seconds: float, slack: float) -> None:
        """Lowers the timeout to ``seconds`` when it is longer by more than ``slack``
        (each change costs a system call; a wait may overrun by ``slack``)."""
        if self.seconds - seconds > slack:
            self.set(seconds)

    def fit(self, seconds: float, slack: float) -> None:
        """Makes the timeout ``seconds`` unless it is already within ``slack`` of it:
        a wait may overrun by ``slack``, or stop short by it (the caller reads again)."""
        if abs(self.seconds - seconds) > slack:
            self.set(seconds)


# What a read or write that ran into the kernel's timeout raises: EAGAIN, which a
# TLS socket reports as wanting to read or write again.
TIMED_OUT = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def recv_into(sock: socket.socket, view: memoryview) -> int:
    """``sock.recv_into(view)``; its kernel timeout passing raises :class:`TimeoutError`."""
    try:
        return sock.recv_into(view)
    except TIMED_OUT:
        raise TimeoutError("the socket's read timed out") from None


def sendall(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    """``sock.sendall(data)``; its kernel timeout passing raises :class:`TimeoutError`
    (part of ``data`` may have gone: the connection cannot carry more frames)."""
    try:
        sock.sendall(data)
    except TIMED_OUT:
        raise TimeoutError("the socket's write timed out") from None


def peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed or reset the connection, seen without reading a byte
    (so it works under TLS too, where a peek would read a record)."""
    poller = select.poll()
    poller.register(sock.fileno(), _PEER_GONE)
    return any(events for _, events in poller.poll(0))


# The peer's FIN (Linux's POLLRDHUP), a hang-up, an error (a reset).
_PEER_GONE = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR
