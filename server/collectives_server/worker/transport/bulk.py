"""The bulk data plane: raw TCP for large tensors, next to the gRPC port.

gRPC in Python cannot move bytes at the wire's speed: every 4 MiB message is
copied into a gRPC slice, out of it into a ``bytes`` object, and again into
the tensor, with the GIL held for the Python part: a fraction of what raw TCP
moves (figures in docs/perf-log.md).
Like Arrow Flight's side channels or Ray's object transfer, the control stays
on gRPC (header, validation, quota, errors, deadlines, auth) and only the
payload goes over a plain TCP connection, straight between the socket and the
tensor's memory (``recv_into``/``sendall`` on a memoryview: no user-space copy).

A transfer is authorised by a one-time 16-byte random ticket that travels in
a gRPC call (so it inherits that call's token check), and is presented as the
first bytes of the connection, in a ``BULK`` prelude (``collectives.wire.frames``).
Which side comes first does not matter (the connection waits for its ticket to
be registered, the call for its connection), and both wait with deadlines. A
worker under TLS serves the port over TLS with its gRPC port's credentials.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from collectives.errors import DeadlineExceeded, InvalidArgument, Unavailable
from collectives.wire.codec import tensor_memoryview
from collectives.wire.frames import (
    ACK,
    BULK,
    LANE,
    NO_TICKET_MARK,
    PRELUDE_BYTES,
    TOKEN_BYTES,
    parse_prelude,
)
from collectives_server.worker.data.limits import BulkLimits

__all__ = ["BulkLimits", "BulkListener", "LaneServer"]

log = logging.getLogger(__name__)


@dataclass
class _Transfer:
    kind: str  # "put" (we receive into view) or "get" (we send view)
    view: memoryview
    keep: torch.Tensor  # owns the memory behind view
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    claimed: bool = False
    moved: int = 0
    error: str = ""
    # Quota held for a GET ticket's bytes (released when sent or expired).
    reservation: Any = None

    def finish(self) -> None:
        self.done.set()
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None


class LaneServer(Protocol):
    """What serves the call lanes (``worker.transport.lanes.CallLanes``): a connection whose
    prelude is a ``LANE`` one (``collectives.wire.frames``) is handed to it for good."""

    calls: Mapping[str, int]  # calls answered on lanes, by method
    methods: tuple[str, ...]  # the methods the lanes carry, by id (from 1; "": not served)

    def issue(self, peer: str, metadata: Any) -> bytes: ...

    def claim(self, ticket: bytes) -> Any | None: ...

    def serve(self, conn: socket.socket, ticket: Any) -> None: ...

    def close(self, grace_s: float) -> None: ...


class BulkListener:
    """Accepts bulk connections and matches them with registered transfers; hands
    call-lane connections to the lane server (:meth:`serve_lanes`)."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        limits: BulkLimits | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.limits = limits or BulkLimits()
        # Every connection a TLS one (a worker under TLS: its gRPC port's certificate).
        self.tls = tls
        self._io_timeout_s = self.limits.idle_s
        self._sock = socket.create_server((host, port), backlog=128)
        self.port: int = self._sock.getsockname()[1]
        self._lock = threading.Condition()
        self._transfers: dict[bytes, _Transfer] = {}
        self._connections: Counter[str] = Counter()
        self.refused_connections = 0  # closed at once for a connection cap (a counter)
        self._closed = False
        self._lanes: LaneServer | None = None
        self._thread = threading.Thread(target=self._accept_loop, name="bulk-accept", daemon=True)
        self._thread.start()

    def serve_lanes(self, lanes: LaneServer) -> None:
        """From now on, connections that open a call lane are served by ``lanes``."""
        self._lanes = lanes

    @property
    def lanes(self) -> LaneServer | None:
        return self._lanes

    # ------------------------------------------------------------ gRPC side
    def receive(self, ticket: bytes, buffer: torch.Tensor, timeout_s: float) -> None:
        """Blocks until a connection presenting ``ticket`` filled ``buffer``.

        Raises:
            InvalidArgument: the ticket is malformed or already in use, or the
                connection sent too few bytes.
            DeadlineExceeded: not filled within ``timeout_s``.
            Unavailable: the listener closed.
        """
        transfer = self._register(ticket, "put", buffer, timeout_s)
        try:
            # A connection must present the ticket within its TTL; once it did,
            # the bytes arrive within the call's time (each read bounded by idle_s).
            started = time.monotonic()
            first = min(timeout_s, self.limits.ticket_ttl_s)
            if not transfer.done.wait(max(first, 0.0)) and not transfer.claimed:
                raise DeadlineExceeded(
                    f"bulk put: {NO_TICKET_MARK} within "
                    f"{first:.3g} s (--bulk-ticket-ttl-s {self.limits.ticket_ttl_s:g})"
                )
            left = timeout_s - (time.monotonic() - started)
            if not transfer.done.wait(max(left, 0.0)):
                raise DeadlineExceeded(
                    f"bulk put: {transfer.moved} of {transfer.view.nbytes} bytes arrived "
                    f"within {timeout_s:.3g} s (no bulk connection presented the ticket?)"
                )
            if transfer.error:
                raise InvalidArgument(f"bulk put: {transfer.error}")
        finally:
            self._unregister(ticket, transfer)

    def offer(
        self, ticket: bytes, tensor: torch.Tensor, ttl_s: float, reservation: Any = None
    ) -> float:
        """Registers ``tensor`` (contiguous, CPU) to be sent to the connection
        presenting ``ticket`` within ``ttl_s`` (at most the ticket TTL); the
        reference is dropped then. Returns the TTL granted."""
        ttl_s = min(ttl_s, self.limits.ticket_ttl_s)
        transfer = self._register(ticket, "get", tensor, ttl_s)
        transfer.reservation = reservation
        return ttl_s

    def refuse(self, ticket: bytes) -> None:
        """Marks a ticket whose call failed before registering, so that its
        connection is closed at once instead of waiting for a registration."""
        if len(ticket) != TOKEN_BYTES:
            return
        with self._lock:
            self._expire_locked()
            if ticket not in self._transfers:
                self._transfers[ticket] = _tombstone()
                self._lock.notify_all()

    def close(self, grace_s: float = 0.0) -> None:
        """Stops accepting; pending transfers fail; the call lanes close, each telling
        its client that no further call runs (the ones running a call get up to
        ``grace_s`` to answer it first)."""
        with self._lock:
            self._closed = True
            pending, self._transfers = list(self._transfers.values()), {}
            self._lock.notify_all()
        for transfer in pending:
            transfer.error = transfer.error or "the worker is shutting down"
            transfer.finish()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._lanes is not None:
            self._lanes.close(grace_s)

    def _register(self, ticket: bytes, kind: str, tensor: torch.Tensor, ttl_s: float) -> _Transfer:
        if len(ticket) != TOKEN_BYTES:
            raise InvalidArgument(f"a bulk ticket is {TOKEN_BYTES} bytes, not {len(ticket)}")
        transfer = _Transfer(
            kind=kind,
            view=tensor_memoryview(tensor),
            keep=tensor,
            deadline=time.monotonic() + max(ttl_s, 0.0),
        )
        with self._lock:
            if self._closed:
                raise Unavailable("the worker's bulk listener is closed")
            self._expire_locked()
            if ticket in self._transfers:
                raise InvalidArgument("this bulk ticket is already in use; draw a new one")
            self._transfers[ticket] = transfer
            self._lock.notify_all()
        return transfer

    def _unregister(self, ticket: bytes, transfer: _Transfer) -> None:
        with self._lock:
            if self._transfers.get(ticket) is transfer:
                del self._transfers[ticket]

    def _expire_locked(self) -> None:
        now = time.monotonic()
        expired = [t for t, x in self._transfers.items() if x.deadline < now and not x.claimed]
        for ticket in expired:
            stale = self._transfers.pop(ticket)
            stale.error = "the ticket expired"
            stale.keep = torch.empty(0)  # the tensor is not pinned past the TTL
            stale.finish()

    # ------------------------------------------------------ connection side
    def _accept_loop(self) -> None:
        # Wakes up every second to drop expired tickets (and the tensors they hold).
        self._sock.settimeout(1.0)
        while True:
            try:
                conn, peer_address = self._sock.accept()
            except TimeoutError:
                with self._lock:
                    self._expire_locked()
                continue
            except OSError:
                return  # closed
            peer = peer_address[0] if isinstance(peer_address, tuple) else str(peer_address)
            if not self._admit(peer):
                conn.close()  # over a cap: closed at once, holding nothing
                continue
            conn.settimeout(None)
            # Replies (acks, a GET's payload) leave at once, not after a delayed ACK.
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(conn, peer), name="bulk-conn", daemon=True
            ).start()

    @property
    def open_connections(self) -> int:
        """Connections being served now (admitted, not yet closed)."""
        with self._lock:
            return sum(self._connections.values())

    def _admit(self, peer: str) -> bool:
        with self._lock:
            if (
                sum(self._connections.values()) >= self.limits.max_connections
                or self._connections[peer] >= self.limits.max_connections_per_peer
            ):
                self.refused_connections += 1
                return False
            self._connections[peer] += 1
            return True

    def _release(self, peer: str) -> None:
        with self._lock:
            self._connections[peer] -= 1
            if self._connections[peer] <= 0:
                del self._connections[peer]

    def _serve(self, conn: socket.socket, peer: str) -> None:
        """Serves transfers on one connection until it closes, idles out, or errs.

        Clients keep connections for reuse, so each transfer starts with its own
        prelude; the first must come within the prelude timeout, later ones
        within the idle timeout (longer than the SDK keeps an idle connection).
        """
        try:
            with conn:
                wait_s = self.limits.prelude_timeout_s
                if self.tls is not None:
                    # The handshake and the first prelude share the prelude timeout.
                    deadline = time.monotonic() + wait_s
                    conn = _tls_handshake(self.tls, conn, deadline)
                    wait_s = max(deadline - time.monotonic(), 0.0)
                with conn:
                    while self._serve_one(conn, wait_s):
                        wait_s = self.limits.idle_s
        except OSError:  # ssl.SSLError too: a failed handshake
            pass
        finally:
            self._release(peer)

    def _serve_one(self, conn: socket.socket, wait_s: float) -> bool:
        """One transfer; True when the connection may carry another.

        The prelude must arrive within ``wait_s`` in total, however it is
        dribbled; then the ticket must be registered within the prelude timeout.
        """
        prelude = _recv_exactly(
            conn, memoryview(bytearray(PRELUDE_BYTES)), time.monotonic() + wait_s
        )
        opened = parse_prelude(prelude) if prelude is not None else None
        if opened is None:
            return False
        kind, version, ticket = opened
        if kind == LANE and self._lanes is not None:
            lane = self._lanes.claim(ticket)
            if lane is not None:
                self._lanes.serve(conn, lane)
            return False
        if kind != BULK:
            return False
        transfer = self._claim(ticket)
        if transfer is None:
            return False
        if version == 2 and transfer.kind == "put":
            try:
                conn.sendall(ACK)  # the ticket is ours: send the payload
            except OSError:
                transfer.error = "the bulk connection closed before the payload"
                transfer.finish()
                return False
        conn.settimeout(self._io_timeout_s)
        try:
            if transfer.kind == "put":
                self._receive_into(conn, transfer)
            else:
                conn.sendall(transfer.view)
                transfer.moved = transfer.view.nbytes
        except OSError as exc:
            transfer.error = transfer.error or f"bulk connection failed: {exc}"
        finally:
            if transfer.kind == "get":
                transfer.keep = torch.empty(0)  # drop the tensor now
            transfer.finish()
        return not transfer.error

    def _claim(self, ticket: bytes) -> _Transfer | None:
        """The transfer registered under ``ticket`` (waiting for its call), or None."""
        deadline = time.monotonic() + self.limits.prelude_timeout_s
        with self._lock:
            while True:
                transfer = self._transfers.get(ticket)
                if transfer is not None and transfer.kind == "refused":
                    return None
                if transfer is not None and not transfer.claimed:
                    transfer.claimed = True
                    if transfer.kind == "get":  # one-time: a replay is refused at once
                        self._transfers[ticket] = _tombstone()
                    return transfer
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0 or transfer is not None:
                    return None
                self._lock.wait(remaining)

    def _receive_into(self, conn: socket.socket, transfer: _Transfer) -> None:
        view = transfer.view
        while transfer.moved < view.nbytes:
            n = conn.recv_into(view[transfer.moved :])
            if n == 0:
                transfer.error = (
                    f"the bulk connection closed after {transfer.moved} of {view.nbytes} bytes"
                )
                return
            transfer.moved += n
        # One byte more would be a protocol error; do not wait for it.


# A spent or refused ticket is remembered this long, so its connection is closed at once.
_TOMBSTONE_S = 30.0


def _tls_handshake(context: ssl.SSLContext, conn: socket.socket, deadline: float) -> ssl.SSLSocket:
    """``conn`` after a TLS handshake done by ``deadline`` (an absolute bound, which a
    client dripping its handshake cannot push back).

    Raises:
        TimeoutError: the handshake did not end in time.
        ssl.SSLError: it failed (no or a wrong client certificate, not TLS).
    """
    tls = context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
    try:  # ``conn`` is detached now: ``tls`` holds the connection
        tls.setblocking(False)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the TLS handshake did not end within the prelude timeout")
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                select.select([tls], [], [], left)
            except ssl.SSLWantWriteError:
                select.select([], [tls], [], left)
        tls.settimeout(None)
    except BaseException:
        tls.close()
        raise
    return tls


def _tombstone() -> _Transfer:
    """A ticket that must not be served: its call failed, or it was spent."""
    return _Transfer(
        kind="refused",
        view=memoryview(b""),
        keep=torch.empty(0),
        deadline=time.monotonic() + _TOMBSTONE_S,
    )


def _recv_exactly(conn: socket.socket, view: memoryview, deadline: float) -> memoryview | None:
    """``view`` filled before ``deadline`` (in total, not per read), else None."""
    got = 0
    while got < view.nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            n = conn.recv_into(view[got:])
        except TimeoutError:
            return None
        if n == 0:
            return None
        got += n
    return view
