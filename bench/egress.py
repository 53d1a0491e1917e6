"""What this process sent over TCP: the payload bytes of its own sockets, per process.

The kernel counts the payload bytes of each TCP socket that its peer acknowledged
(``tcp_info.tcpi_bytes_acked``, RFC 4898's ThruOctetsAcked: each byte once, even
when it was retransmitted, plus 1 for the SYN); ``ss -tie`` prints it beside each
socket's inode, and ``/proc/self/fd`` says which inodes are this process's.
``bytes_sent`` would count retransmissions, and a busy 2-core machine does drop
segments on loopback (~0.9 % extra for 100 MB in one test). Neither
``/proc/self/io`` (its ``wchar`` counts ``write()``, not ``send()``/``sendmsg()``,
which gRPC and the bulk port use) nor the loopback interface's counters (every
process on the machine) would do.

:class:`TcpEgress` takes a snapshot before and after a call. A socket that
opened during the call counts from zero; one that closed during it took its
last bytes along, so the figure is then a lower bound (``closed`` says how
many); one that opened *and* closed inside the call is invisible. The SDK keeps
its gRPC channels and pools its bulk connections, so after a warm-up call
neither happens (check ``closed``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["TcpEgress", "EgressCount", "EgressLog", "own_tcp_bytes_acked", "available"]

_INODE = re.compile(r"\bino:(\d+)")
_ACKED = re.compile(r"\bbytes_acked:(\d+)")


def available() -> bool:
    """Whether ``ss`` and ``/proc/self/fd`` are here (Linux)."""
    return shutil.which("ss") is not None and os.path.isdir("/proc/self/fd")


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def parse_ss(text: str) -> dict[int, int]:
    """``{inode: bytes_acked}`` from ``ss -tieH`` output (one socket per header line, its
    tcp_info on the indented lines below; a listening socket has no ``bytes_acked``)."""
    acked: dict[int, int] = {}
    inode: int | None = None
    for line in text.splitlines():
        if line and not line[0].isspace():  # a socket's header line
            m = _INODE.search(line)
            inode = int(m.group(1)) if m else None
            if inode is not None:
                acked[inode] = 0
        m = _ACKED.search(line)
        if m and inode is not None:
            acked[inode] = int(m.group(1))
    return acked


def own_tcp_bytes_acked() -> dict[int, int]:
    """``{inode: bytes_acked}`` for every TCP socket (IPv4 and IPv6) this process holds."""
    mine = _own_socket_inodes()
    out = subprocess.run(
        ["ss", "-tieHn", "state", "all"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return {ino: n for ino, n in parse_ss(out).items() if ino in mine}


@dataclass(frozen=True)
class EgressCount:
    nbytes: int  # payload bytes this process's TCP sockets had acked in the window
    closed: int  # sockets open at the start and gone at the end: nbytes is then a lower bound


class TcpEgress:
    """``start()`` before a call and ``stop()`` after it (both outside any timed region:
    each runs ``ss``, ~10 ms)."""

    def __init__(self) -> None:
        self._before: dict[int, int] = {}

    def start(self) -> None:
        self._before = own_tcp_bytes_acked()

    def stop(self) -> EgressCount:
        after = own_tcp_bytes_acked()
        sent = sum(n - self._before.get(ino, 0) for ino, n in after.items())
        closed = len(set(self._before) - set(after))
        return EgressCount(sent, closed)


class EgressLog:
    """The egress of each timed call of ``core.timed``: :meth:`start` at the end of its
    ``prepare``, :meth:`record` as its ``after`` (both outside the timed region). Does
    nothing where :func:`available` is False (``sent`` then stays empty)."""

    def __init__(self) -> None:
        self.counting = available()
        self._counter = TcpEgress()
        self.sent: list[int] = []
        self.closed = 0

    def start(self) -> None:
        if self.counting:
            self._counter.start()

    def record(self, _i: int = 0) -> None:
        if self.counting:
            got = self._counter.stop()
            self.sent.append(got.nbytes)
            self.closed += got.closed
