"""A generation's control collectives over plain TCP, read and written by the caller.

Every op costs control rounds among all ranks: the leader's announcement (a
broadcast), the operand exchange and the outcome agreement (all-gathers of
small rows). Through gloo each round costs two thread hand-offs per rank (the
caller's enqueue wakes gloo's worker thread, whose completion wakes the caller
again), which on a busy host is most of a small op's time; the same bytes
over a socket the calling thread reads and writes itself take a fraction of
it, with a far shorter tail (figures in docs/perf-log.md).

:class:`ControlChannel` speaks the control rounds' byte interface
(``control_rounds.ControlRounds``): the leader's announcement of a message
of any length, and an all-gather of equal-length rows. Each call completes
before it returns, so calls complete in issue order on every rank. Rank 0
(the leader, which announces every op) is the hub of a star: an announcement
is the leader writing the bytes to each follower; an all-gather is each
follower writing its row to the leader, who answers each with the whole
table. No tensor is involved: the rows are ``bytearray`` s, which on a 4 B op
saves the dozen small tensor calls that packing and unpacking through
tensors cost at every rank.

Rendezvous goes through the generation's store, as gloo's does: the leader
listens on the worker's host and publishes its address, port and a random
token under the group's prefix; each follower connects with a ``CONTROL``
prelude carrying the token, then a ``HELLO`` frame with its rank. Frames
(``collectives.wire.frames``) carry a kind and a length that the receiver
checks against what it expects, so ranks that fell out of step fail loudly.

The sockets are blocking, their timeouts kept by the kernel
(``collectives.wire.socket_timeouts``): a read or write is one system call and
one drop of the GIL, which the generation thread, on the path of every op,
takes back only behind the other threads that took it meanwhile.

Only the generation thread uses a channel. A peer that closed, reset or stayed
silent past the op timeout raises ``RuntimeError`` naming it (a transport
failure: ``OpContext.call`` turns it into ``GroupBroken``); :meth:`close` on
teardown makes the peers' next read fail at once instead of at their timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import socket
import struct
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from collectives.wire import socket_timeouts
from collectives.wire.frames import (
    ACK,
    CONTROL,
    CONTROL_BROADCAST,
    CONTROL_HELLO,
    CONTROL_ROW,
    CONTROL_TABLE,
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    PRELUDE_BYTES,
    new_token,
    parse_prelude,
    prelude,
)
from collectives.wire.socket_timeouts import KernelTimeouts
from collectives_server.hosts import dialled_name, is_wildcard

if TYPE_CHECKING:
    from collectives_server.worker.engine.control_rounds import Buffer, Waitable

__all__ = ["ControlChannel"]

_FRAME = FRAME_HEADER
_RANK = struct.Struct("<I")  # a HELLO frame's payload
_KIND_NAMES = {
    CONTROL_BROADCAST: "broadcast",
    CONTROL_ROW: "row",
    CONTROL_TABLE: "table",
    CONTROL_HELLO: "hello",
}
_HELLO_BYTES = PRELUDE_BYTES + _FRAME.size + _RANK.size
_ALIGN = 16
_SMALL = 64 * 1024  # frames up to this size go out in one send
_SLACK_S = 0.1  # a read may outlast its deadline by this much (see _read_exact)


class ControlChannel:
    """The control rounds of one generation's group (see the module docstring)."""

    def __init__(self, rank: int, size: int, timeout_s: float, peers: dict[int, socket.socket]):
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self._peers = peers  # leader: every follower's socket; follower: {0: the leader's}
        self._followers = sorted(peers) if rank == 0 else []
        self._closed = False
        # Once: each read or send is bounded by it (lowered near a deadline).
        self._timeouts = {peer: KernelTimeouts(sock, timeout_s) for peer, sock in peers.items()}

    # -- forming it ---------------------------------------------------------

    @classmethod
    def connect(
        cls, store: dist.Store, rank: int, size: int, timeout_s: float, host: str | None
    ) -> ControlChannel:
        """Blocks until every rank is connected to the leader (or ``timeout_s`` passes).
        ``store`` is this group's (prefixed) store; ``host`` the worker's listening host."""
        if size == 1:
            return cls(rank, size, timeout_s, {})
        if rank == 0:
            return cls(rank, size, timeout_s, _accept_followers(store, size, timeout_s, host))
        return cls(rank, size, timeout_s, {0: _join_leader(store, rank, timeout_s)})

    def close(self) -> None:
        """Closes every connection; the peers' reads then fail at once."""
        self._closed = True
        for sock in self._peers.values():
            with contextlib.suppress(OSError):  # already closed by the peer
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    # -- the control rounds (``control_rounds.ControlRounds``) ----------------

    def announce(self, message: bytes) -> None:
        """Leader: ``message`` to every follower (sent when this returns)."""
        if self.rank != 0:
            raise ValueError("only the leader (rank 0) announces")
        for r in self._followers:
            self._send(r, CONTROL_BROADCAST, message)

    def receive_announcement(self, max_bytes: int) -> bytes:
        """Follower: the leader's next announcement (at most ``max_bytes``)."""
        sock = self._sock(0)
        deadline = time.monotonic() + self.timeout_s
        head = bytearray(_FRAME.size)
        timeouts = self._timeouts[0]
        _read_exact(sock, timeouts, memoryview(head), deadline, 0, self.timeout_s)
        kind, nbytes = _FRAME.unpack(head)
        if kind != CONTROL_BROADCAST or nbytes > max_bytes:
            raise RuntimeError(
                f"control channel out of step with rank 0: expected an announcement of at "
                f"most {max_bytes} bytes, got a {_KIND_NAMES.get(kind, kind)} of {nbytes}"
            )
        body = bytearray(nbytes)
        _read_exact(sock, timeouts, memoryview(body), deadline, 0, self.timeout_s)
        return bytes(body)

    def all_gather(self, row: Buffer, before: Waitable | None = None) -> memoryview:
        """Every rank's ``row`` (the same length on every rank), in rank order, on every
        rank: a fresh table of ``size`` rows. ``before``: waited on first."""
        if before is not None:
            before.wait()
        mine = memoryview(row).cast("B")
        width = len(mine)
        if self.rank != 0:
            self._send(0, CONTROL_ROW, mine)
            return self._recv(0, CONTROL_TABLE, width * self.size)
        table = bytearray(width * self.size)
        view = memoryview(table)
        view[:width] = mine
        for r in self._followers:
            view[r * width : (r + 1) * width] = self._recv(r, CONTROL_ROW, width)
        for r in self._followers:
            self._send(r, CONTROL_TABLE, view)
        return view

    # -- framing ------------------------------------------------------------

    def _sock(self, peer: int) -> socket.socket:
        if self._closed:
            raise RuntimeError("control channel: connection closed (the group was torn down)")
        return self._peers[peer]

    def _send(self, peer: int, kind: int, payload: Buffer) -> None:
        sock = self._sock(peer)
        if len(payload) > MAX_FRAME_BYTES:
            raise RuntimeError(f"control channel: a frame of {len(payload)} bytes is too large")
        head = _FRAME.pack(kind, len(payload))
        try:
            if len(payload) <= _SMALL:
                socket_timeouts.sendall(sock, head + payload)
            else:
                socket_timeouts.sendall(sock, head)
                socket_timeouts.sendall(sock, payload)
        except TimeoutError as exc:
            raise RuntimeError(
                f"control channel: timed out after {self.timeout_s:g}s sending to rank {peer}"
            ) from exc
        except OSError as exc:
            raise RuntimeError(f"control channel: connection to rank {peer} failed: {exc}") from exc

    def _recv(self, peer: int, kind: int, nbytes: int) -> memoryview:
        """The payload of ``peer``'s next frame, which must be a ``kind`` of ``nbytes``
        (header and payload read together: one system call when it has all arrived)."""
        sock = self._sock(peer)
        deadline = time.monotonic() + self.timeout_s
        # The header ends where the payload starts 16-byte aligned: tensors view it.
        frame = memoryview(bytearray(_ALIGN + nbytes))[_ALIGN - _FRAME.size :]
        timeouts = self._timeouts[peer]
        got = _read_exact(sock, timeouts, frame, deadline, peer, self.timeout_s, _FRAME.size)
        got_kind, got_bytes = _FRAME.unpack(frame[: _FRAME.size])
        if got_kind != kind or got_bytes != nbytes:
            raise RuntimeError(
                f"control channel out of step with rank {peer}: expected a "
                f"{_KIND_NAMES.get(kind)} of {nbytes} bytes, got a "
                f"{_KIND_NAMES.get(got_kind, got_kind)} of {got_bytes}"
            )
        _read_exact(sock, timeouts, frame, deadline, peer, self.timeout_s, start=got)
        return frame[_FRAME.size :]


def _read_exact(
    sock: socket.socket,
    timeouts: KernelTimeouts,
    into: memoryview,
    deadline: float,
    peer: int,
    timeout_s: float,
    until: int | None = None,
    start: int = 0,
) -> int:
    """Fills ``into`` from ``start`` until ``until`` bytes of it (all of it by default)
    are filled, by ``deadline``; returns how many are (it may read beyond ``until``,
    never beyond ``into``). The socket's timeout (``timeouts``) bounds each read; it
    is lowered to what is left only when that is shorter by more than ``_SLACK_S``
    (setting it costs a system call), and put back afterwards."""
    need = len(into) if until is None else until
    got = start
    preset = timeouts.seconds
    try:
        while got < need:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"control channel: timed out after {timeout_s:g}s waiting for rank {peer}"
                )
            timeouts.at_most(left, _SLACK_S)
            try:
                n = socket_timeouts.recv_into(sock, into[got:])
            except TimeoutError:
                continue  # the deadline check above reports it
            except OSError as exc:
                raise RuntimeError(
                    f"control channel: connection to rank {peer} failed: {exc}"
                ) from exc
            if n == 0:
                raise RuntimeError(f"control channel: connection closed by rank {peer}")
            got += n
    finally:
        if timeouts.seconds != preset:
            with contextlib.suppress(OSError):
                timeouts.set(preset)
    return got


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def _listen_host(host: str | None) -> tuple[str, str]:
    """(address to bind, address the followers dial): the worker's own host, or on a
    wildcard host every interface and this machine's name, as gloo's device does."""
    if not is_wildcard(host):
        return host, dialled_name(host)
    return ("::" if host in ("::", "[::]") else ""), dialled_name(host)


def _accept_followers(
    store: dist.Store, size: int, timeout_s: float, host: str | None
) -> dict[int, socket.socket]:
    bind, dial = _listen_host(host)
    v6 = ":" in bind
    listener = socket.create_server(
        (bind, 0),
        family=socket.AF_INET6 if v6 else socket.AF_INET,
        backlog=size,
        dualstack_ipv6=v6 and bind == "::" and socket.has_dualstack_ipv6(),
    )
    token = new_token()
    peers: dict[int, socket.socket] = {}
    try:
        port = listener.getsockname()[1]
        store.set("address", f"{dial}\n{port}\n{token.hex()}")
        deadline = time.monotonic() + timeout_s
        while len(peers) < size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, size)) - set(peers))
                raise RuntimeError(
                    f"control channel: timed out after {timeout_s:g}s waiting for rank(s) "
                    f"{missing} to connect"
                )
            listener.settimeout(left)
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            rank = _hello(_tune(sock), token, size, deadline)
            if rank is None or rank in peers:
                sock.close()  # not one of this group's ranks: ignore it
                continue
            peers[rank] = sock
        for sock in peers.values():
            sock.sendall(ACK)
        return peers
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    finally:
        listener.close()


def _hello(sock: socket.socket, token: bytes, size: int, deadline: float) -> int | None:
    """The connecting follower's rank, or None if it did not say it right in time (a
    prelude of another kind or version, the wrong token, a rank out of range)."""
    buf = bytearray(_HELLO_BYTES)
    try:
        timeouts = KernelTimeouts(sock, 5.0)
        _read_exact(sock, timeouts, memoryview(buf), min(deadline, time.monotonic() + 5.0), -1, 5.0)
    except RuntimeError:
        return None
    opened = parse_prelude(buf[:PRELUDE_BYTES])
    kind, length = _FRAME.unpack_from(buf, PRELUDE_BYTES)
    if opened is None or opened[0] != CONTROL or (kind, length) != (CONTROL_HELLO, _RANK.size):
        return None
    (rank,) = _RANK.unpack_from(buf, PRELUDE_BYTES + _FRAME.size)
    if not secrets.compare_digest(opened[2], token) or not 1 <= rank < size:
        return None
    return rank


def _join_leader(store: dist.Store, rank: int, timeout_s: float) -> socket.socket:
    try:
        store.wait(["address"], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise RuntimeError(
            f"control channel: timed out after {timeout_s:g}s waiting for the leader's address"
        ) from exc
    dial, port, token = store.get("address").decode().split("\n")
    deadline = time.monotonic() + timeout_s
    try:
        sock = _tune(socket.create_connection((dial, int(port)), timeout=timeout_s))
    except OSError as exc:
        raise RuntimeError(f"control channel: could not reach the leader: {exc}") from exc
    try:
        hello = _FRAME.pack(CONTROL_HELLO, _RANK.size) + _RANK.pack(rank)
        sock.sendall(prelude(CONTROL, bytes.fromhex(token)) + hello)
        ack = bytearray(1)
        try:
            timeouts = KernelTimeouts(sock, timeout_s)
            _read_exact(sock, timeouts, memoryview(ack), deadline, 0, timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(
                f"{exc} (the leader closes a follower whose hello it does not accept: a "
                "stale token, or a release that speaks another control-channel version)"
            ) from exc
        if bytes(ack) != ACK:
            raise RuntimeError("control channel: the leader answered the hello with no ACK")
    except BaseException:
        sock.close()
        raise
    return sock
