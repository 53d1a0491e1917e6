"""A generation's control collectives over plain TCP, read and written by the caller.

Every op costs control rounds among all ranks: the leader's announcement (a
broadcast), the operand exchange and the outcome agreement (all-gathers of
small rows). Through gloo each round costs two thread hand-offs per rank (the
caller's enqueue wakes gloo's worker thread, whose completion wakes the caller
again), which on a busy host is most of a small op's time. Measured on the
2-core VM, an announcement plus an exchange at world 2: gloo 490-610 µs p50
and 4.4-7.5 ms p99; the same bytes over a socket the calling thread reads and
writes itself, 46-49 µs p50 and 86-96 µs p99.

:class:`ControlChannel` offers the two calls the control plane makes on a
process group, ``broadcast([t], opts)`` from rank 0 and ``_allgather_base(out,
row)``, with the same meaning and the same issue-order guarantee, so
``descriptor`` and ``agreement`` run on either. Rank 0 (the leader, which
announces every op) is the hub of a star: a broadcast is the leader writing
the bytes to each follower; an all-gather is each follower writing its row to
the leader, who answers each with the whole table.

Rendezvous goes through the generation's store, as gloo's does: the leader
listens on the worker's host and publishes its address, port and a random
token under the group's prefix; each follower connects and presents its rank
and the token. Frames carry a kind and a length that the receiver checks
against what it expects, so ranks that fell out of step fail loudly.

Only the generation thread uses a channel. A peer that closed, reset or stayed
silent past the op timeout raises ``RuntimeError`` naming it (a transport
failure: ``OpContext.call`` turns it into ``GroupBroken``); :meth:`close` on
teardown makes the peers' next read fail at once instead of at their timeout.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import secrets
import socket
import struct
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from collectives.wire.codec import tensor_memoryview
from collectives_server.hosts import dialled_name, is_wildcard

__all__ = ["ControlChannel"]

_FRAME = struct.Struct("<BQ")  # kind, payload bytes
_HELLO = struct.Struct("<q16s")  # rank, token
_BROADCAST, _ROW, _TABLE = 1, 2, 3
_KIND_NAMES = {_BROADCAST: "broadcast", _ROW: "row", _TABLE: "table"}
_SMALL = 64 * 1024  # frames up to this size go out in one send
_TOKEN_BYTES = 16


class _Work:
    """What a channel call returns: :meth:`wait` completes it (and, first, every call
    this rank issued before it)."""

    __slots__ = ("_channel", "_finish", "done")

    def __init__(self, channel: ControlChannel, finish: Callable[[], None] | None) -> None:
        self._channel = channel
        self._finish = finish
        self.done = finish is None

    def wait(self) -> bool:
        self._channel._complete_through(self)
        return True

    def _run(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        self.done = True


class ControlChannel:
    """The control rounds of one generation's group (see the module docstring)."""

    def __init__(self, rank: int, size: int, timeout_s: float, peers: dict[int, socket.socket]):
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self._peers = peers  # leader: every follower's socket; follower: {0: the leader's}
        self._followers = sorted(peers) if rank == 0 else []
        self._pending: collections.deque[_Work] = collections.deque()
        self._closed = False

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
        self._pending.clear()

    # -- the process-group calls the control plane makes --------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> _Work:
        """``tensors[0]`` of the leader into ``tensors[0]`` of every rank (root 0 only)."""
        if opts.rootRank != 0 or len(tensors) != 1:
            raise ValueError("the control channel broadcasts one tensor from rank 0 only")
        self._drain()
        t = tensors[0]
        if self.rank == 0:
            view = _bytes(t)
            for r in self._followers:
                self._send(r, _BROADCAST, view)
            return _Work(self, None)
        return self._issue(lambda: self._recv(0, _BROADCAST, _bytes(t)))

    def _allgather_base(self, out: torch.Tensor, row: torch.Tensor) -> _Work:
        """Every rank's ``row`` into ``out`` (``size`` rows, rank order), on every rank."""
        if out.numel() != row.numel() * self.size or out.dtype != row.dtype:
            raise ValueError("all-gather output must hold size x the row, same dtype")
        self._drain()
        table = _bytes(out)
        width = row.numel() * row.element_size()
        if width:
            table[self.rank * width : (self.rank + 1) * width] = _bytes(row)
        if self.rank != 0:
            self._send(0, _ROW, table[self.rank * width : (self.rank + 1) * width])
            return self._issue(lambda: self._recv(0, _TABLE, table))

        def gather_and_answer() -> None:
            for r in self._followers:
                self._recv(r, _ROW, table[r * width : (r + 1) * width])
            for r in self._followers:
                self._send(r, _TABLE, table)

        return self._issue(gather_and_answer)

    # -- issue order --------------------------------------------------------

    def _issue(self, finish: Callable[[], None]) -> _Work:
        work = _Work(self, finish)
        self._pending.append(work)
        return work

    def _drain(self) -> None:
        """Completes every call issued so far: each call's bytes go out, and come in, in
        issue order on every rank, as on a process group."""
        while self._pending:
            self._pending.popleft()._run()

    def _complete_through(self, work: _Work) -> None:
        while not work.done:
            if not self._pending:
                raise RuntimeError("control channel: waited on a call that was never issued")
            self._pending.popleft()._run()

    # -- framing ------------------------------------------------------------

    def _sock(self, peer: int) -> socket.socket:
        if self._closed:
            raise RuntimeError("control channel: connection closed (the group was torn down)")
        return self._peers[peer]

    def _send(self, peer: int, kind: int, payload: memoryview) -> None:
        sock = self._sock(peer)
        head = _FRAME.pack(kind, len(payload))
        try:
            sock.settimeout(self.timeout_s)
            if len(payload) <= _SMALL:
                sock.sendall(head + payload)
            else:
                sock.sendall(head)
                sock.sendall(payload)
        except TimeoutError as exc:
            raise RuntimeError(
                f"control channel: timed out after {self.timeout_s:g}s sending to rank {peer}"
            ) from exc
        except OSError as exc:
            raise RuntimeError(f"control channel: connection to rank {peer} failed: {exc}") from exc

    def _recv(self, peer: int, kind: int, into: memoryview) -> None:
        sock = self._sock(peer)
        deadline = time.monotonic() + self.timeout_s
        head = bytearray(_FRAME.size)
        _read_exact(sock, memoryview(head), deadline, peer, self.timeout_s)
        got_kind, nbytes = _FRAME.unpack(head)
        if got_kind != kind or nbytes != len(into):
            raise RuntimeError(
                f"control channel out of step with rank {peer}: expected a "
                f"{_KIND_NAMES.get(kind)} of {len(into)} bytes, got a "
                f"{_KIND_NAMES.get(got_kind, got_kind)} of {nbytes}"
            )
        _read_exact(sock, into, deadline, peer, self.timeout_s)


def _bytes(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("the control channel moves contiguous CPU tensors only")
    return tensor_memoryview(t)


def _read_exact(
    sock: socket.socket, into: memoryview, deadline: float, peer: int, timeout_s: float
) -> None:
    got = 0
    while got < len(into):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(
                f"control channel: timed out after {timeout_s:g}s waiting for rank {peer}"
            )
        try:
            sock.settimeout(left)
            n = sock.recv_into(into[got:])
        except TimeoutError:
            continue  # the deadline check above reports it
        except OSError as exc:
            raise RuntimeError(f"control channel: connection to rank {peer} failed: {exc}") from exc
        if n == 0:
            raise RuntimeError(f"control channel: connection closed by rank {peer}")
        got += n


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
    token = secrets.token_bytes(_TOKEN_BYTES)
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
            sock.sendall(b"\x01")
        return peers
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    finally:
        listener.close()


def _hello(sock: socket.socket, token: bytes, size: int, deadline: float) -> int | None:
    """The connecting follower's rank, or None if it did not say it right in time."""
    buf = bytearray(_HELLO.size)
    try:
        _read_exact(sock, memoryview(buf), min(deadline, time.monotonic() + 5.0), -1, 5.0)
    except RuntimeError:
        return None
    rank, presented = _HELLO.unpack(buf)
    if not secrets.compare_digest(presented, token) or not 1 <= rank < size:
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
        sock.sendall(_HELLO.pack(rank, bytes.fromhex(token)))
        ack = bytearray(1)
        _read_exact(sock, memoryview(ack), deadline, 0, timeout_s)
    except BaseException:
        sock.close()
        raise
    return sock
