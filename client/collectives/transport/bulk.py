"""The bulk data plane, client side: large payloads over raw TCP beside gRPC.

gRPC carries the control (header, validation, quota, errors, deadlines, the
bearer token); a plain TCP connection to the worker's bulk port carries only
the bytes, between the socket and the tensor's memory with no copy in user
space. The connection opens with a ``BULK`` prelude carrying a one-time random
ticket that travelled in the gRPC call, so only that call's caller can feed or
read it. A put sends the call and the bytes at the same time; a get asks first
(small tensors come back inline) and then pulls the bytes with its ticket.

A worker under TLS serves its bulk port over TLS (``DataPlaneResponse.bulk_tls``),
and a TLS client's connections to it are TLS ones (:mod:`collectives.wire.raw_tls`);
with ``--no-bulk`` (``bulk_port`` 0), or a port of the other kind than the
client's channel, the SDK streams over gRPC.

A leaf of the SDK: it imports :mod:`collectives.wire` (the framing it shares
with the worker, :mod:`collectives.wire.frames`), :mod:`collectives.errors`
and the generated stubs, nothing else of the SDK; whether a transfer takes the
bulk port at all is decided in :func:`collectives.transport.roads.choose_path`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Protocol

import grpc
import torch

from collectives._deadlines import time_left, timeout_left
from collectives.errors import (
    CollectiveError,
    DeadlineExceeded,
    InvalidArgument,
    Unavailable,
    channel_was_closed,
    closed_handle,
    error_for_code,
)
from collectives.errors import from_rpc_error as _from_rpc_error
from collectives.v1 import worker_pb2
from collectives.wire import codec, socket_timeouts
from collectives.wire.frames import ACK, BULK, NO_TICKET_MARK, new_token, prelude
from collectives.wire.memory import empty_bytes

if TYPE_CHECKING:
    from collectives.v1 import worker_pb2_grpc

__all__ = [
    "BulkEndpoint",
    "BulkPort",
    "BulkUnreachable",
    "put_tensor_bulk",
    "get_tensor_bulk",
    "host_of",
    "looks_open",
]

log = logging.getLogger(__name__)

# How long a put waits for the worker's ACK before it takes the stream instead.
ACK_TIMEOUT_S = 5.0
# Connections are kept for reuse at most this long idle (workers wait 60 s),
# and at most this many per worker.
_IDLE_KEEP_S = 20.0
_MAX_IDLE = 4
# A put checks between pieces whether its call was already refused.
_SEND_PIECE = 16 << 20


class BulkUnreachable(Unavailable):
    """The bulk port refused or dropped the connection before any payload moved:
    safe to send the same payload through the gRPC stream instead."""


# After the bulk port of a worker refused us, use its gRPC stream this long.
SUSPEND_S = 30.0


class BulkPort:
    """What one worker said about its bulk port, asked once per channel.

    ``port`` is None until asked, 0 when the worker has none (``--no-bulk``, or a
    worker that predates it) or one of the other kind (see ``tls``). Forgotten
    after a refused connection, so a restarted worker's new port is asked for again.

    ``tls`` (a client whose own channel is TLS: its channel's CA and client
    certificate, :func:`collectives.wire.raw_tls.client_context`): only a bulk port
    that the worker serves over TLS is used, every connection to it a TLS one that
    checks the worker's certificate; a plaintext port is 0 to this client, so a TLS
    client never sends a call or a tensor in cleartext, even to a plaintext worker
    behind a TLS proxy that offers one. Without ``tls``, a TLS port is 0 likewise.
    """

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._port: int | None = None
        self._idle: list[tuple[float, socket.socket]] = []  # (since, connection)
        self._suspended_until = 0.0

    def port(self, endpoint: BulkEndpoint, timeout: float) -> int:
        """The bulk port; 0 when the worker has none, or while it is suspended, or
        when it speaks TLS and this client not, or the other way round."""
        with self._lock:
            if time.monotonic() < self._suspended_until:
                return 0
            if self._port is not None:
                return self._port
        what = f"GetDataPlane on {endpoint.address}"
        try:
            response = endpoint.stub.GetDataPlane(
                worker_pb2.DataPlaneRequest(), timeout=max(min(timeout, 5.0), 0.001)
            )
            port = int(response.bulk_port) if response.bulk_tls == (self.tls is not None) else 0
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _from_rpc_error(err, what) from None
            port = 0
        except ValueError as err:
            if not channel_was_closed(err):
                raise
            raise closed_handle(what) from None
        with self._lock:
            self._port = port
        return port

    def suspend(self, seconds: float = SUSPEND_S) -> None:
        """Use the gRPC stream for this worker for ``seconds`` (its bulk port is full)."""
        with self._lock:
            self._suspended_until = time.monotonic() + seconds
        log.info("bulk port unreachable: using the gRPC stream for %g s", seconds)

    def forget(self) -> None:
        with self._lock:
            self._port = None
            idle, self._idle = self._idle, []
        for _, sock in idle:
            sock.close()

    def connection(self, host: str, port: int, timeout: float) -> socket.socket:
        """A kept connection to ``host:port`` that still looks open, else a new one.

        Raises:
            OSError: a new connection failed.
        """
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    break
                since, sock = self._idle.pop()
            if now - since < _IDLE_KEEP_S and looks_open(sock):
                return sock
            sock.close()
        return self.dial(host, port, timeout)

    def dial(self, host: str, port: int, timeout: float) -> socket.socket:
        """A new connection to ``host:port``, through TLS for a TLS client (the
        worker's certificate checked against ``host``), not yet used.

        Raises:
            OSError: the connection or its TLS handshake failed.
        """
        sock = socket.create_connection((host, port), timeout=timeout)
        # A prelude, then a payload whose last segment is short: with Nagle's
        # algorithm that segment waits for the ACK of the previous ones, which the
        # worker delays: every put would wait out a delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is None:
            return sock
        try:
            return self.tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise

    def keep(self, sock: socket.socket) -> None:
        """Keeps a connection whose last transfer completed, for the next one."""
        with self._lock:
            if self._port and len(self._idle) < _MAX_IDLE:
                self._idle.append((time.monotonic(), sock))
                return
        sock.close()


class BulkEndpoint(Protocol):
    """What a transfer needs of a worker's endpoint (the SDK's ``WorkerEndpoint``)."""

    @property
    def address(self) -> str: ...

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub: ...

    @property
    def bulk(self) -> BulkPort: ...


def _ticket_never_arrived(err: grpc.RpcError) -> bool:
    """The worker's answer when no bulk connection presented the put's ticket."""
    return err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and NO_TICKET_MARK in (
        err.details() or ""
    )


def looks_open(sock: socket.socket) -> bool:
    """False when the peer closed (EOF), reset, or (plaintext) sent bytes we did not
    ask for. A TLS connection may carry records nobody asked for (session
    tickets): only its close or reset counts."""
    if isinstance(sock, ssl.SSLSocket):
        return not socket_timeouts.peer_closed(sock)
    try:
        sock.setblocking(False)
        try:
            sock.recv(1, socket.MSG_PEEK)  # b"" (EOF) or stray bytes: not reusable
        except BlockingIOError:
            return True  # nothing to read: open and idle
        return False
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            sock.setblocking(True)


def _left(deadline: float, what: str, done: int, total: int) -> float:
    """Seconds left before ``deadline``; raises DeadlineExceeded once it passed."""
    return time_left(deadline, f"{what} (after {done} of {total} bytes)")


def host_of(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _connect(
    endpoint: BulkEndpoint, port: int, ticket: bytes, timeout: float, acked: bool = False
) -> socket.socket:
    """A connection (kept or new) to the worker's bulk port, its prelude sent (and,
    with ``acked``, the worker's acknowledgement of the ticket received).

    Raises:
        DeadlineExceeded: ``timeout`` is already spent.
        BulkUnreachable: the port refused the connection or closed it.
    """
    timeout = timeout_left(timeout, f"bulk connection to {endpoint.address}")
    try:
        sock = endpoint.bulk.connection(host_of(endpoint.address), port, timeout)
    except OSError as exc:
        endpoint.bulk.forget()
        raise BulkUnreachable(
            f"bulk port {port} of {endpoint.address} refused the connection: {exc}"
        ) from None
    try:
        sock.settimeout(timeout)
        sock.sendall(prelude(BULK, ticket, version=2 if acked else 1))
        if acked:
            sock.settimeout(min(timeout, ACK_TIMEOUT_S))
            if sock.recv(1) != ACK:
                raise ConnectionResetError("the worker closed the bulk connection")
    except OSError as exc:
        sock.close()
        raise BulkUnreachable(f"bulk port {port} of {endpoint.address}: {exc}") from None
    return sock


def put_tensor_bulk(
    endpoint: BulkEndpoint,
    port: int,
    name: str,
    t: torch.Tensor,
    timeout: float,
    progress: codec.Advance | None = None,
) -> worker_pb2.PutTensorResponse:
    """Stores ``t`` (CPU, contiguous, wire layout) through the bulk port.

    ``progress`` is advanced by the bytes as they are sent.

    The call and the connection run at once; the call answers after the bytes
    arrived, or at once when it refuses the tensor (quota, bad header), which
    also stops the sending.

    Raises:
        CollectiveError: the worker refused the tensor or the call failed;
            Unavailable when the connection broke (safe to retry).
    """
    what = f"PutTensorBulk {name!r} to {endpoint.address}"
    ticket = new_token()
    deadline = time.monotonic() + timeout
    request = worker_pb2.PutTensorBulkRequest(header=codec.make_header(name, t), ticket=ticket)
    try:
        call = endpoint.stub.PutTensorBulk.future(request, timeout=max(timeout, 0.001))
    except ValueError as err:
        if not channel_was_closed(err):
            raise
        raise closed_handle(what) from None
    try:
        sock = _connect(endpoint, port, ticket, timeout, acked=True)
    except Unavailable:
        call.cancel()
        raise
    kept = False
    try:
        view = codec.tensor_memoryview(t)
        try:
            for start in range(0, len(view), _SEND_PIECE):
                if call.done():  # refused (or failed): stop sending
                    break
                sock.settimeout(_left(deadline, what, start, len(view)))
                sock.sendall(view[start : start + _SEND_PIECE])
                if progress is not None:
                    progress.advance(min(_SEND_PIECE, len(view) - start))
        except DeadlineExceeded:
            call.cancel()
            raise
        except TimeoutError:
            call.cancel()
            raise DeadlineExceeded(f"{what}: timed out sending the payload") from None
        except OSError as exc:
            if not call.done():
                call.cancel()
                # The worker closed the connection (a full bulk port closes at
                # once); the put was not stored, so the stream may carry it.
                raise BulkUnreachable(f"{what}: the bulk connection failed: {exc}") from None
            sent_all = False  # the call's answer tells; this connection is done for
        else:
            sent_all = True
        try:
            response = call.result(timeout=max(deadline - time.monotonic(), 0.0) + 1.0)
        except grpc.RpcError as err:
            if _ticket_never_arrived(err):
                # Our bytes went into a connection the worker closed unread (its
                # bulk port is full): nothing was stored, the stream may carry it.
                raise BulkUnreachable(f"{what}: {err.details()}") from None
            raise _from_rpc_error(err, what) from None
        except FutureTimeout:
            call.cancel()
            raise error_for_code(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: no answer") from None
        if sent_all:
            endpoint.bulk.keep(sock)
            kept = True
        return response
    finally:
        if not kept:
            sock.close()


def get_tensor_bulk(
    endpoint: BulkEndpoint,
    port: int,
    name: str,
    timeout: float,
    consume: bool = False,
    progress: Callable[[int], codec.Advance] | None = None,
    out: torch.Tensor | None = None,
    result_of: worker_pb2.ResultOf | None = None,
) -> torch.Tensor:
    """Downloads ``name``: inline when small, else over the bulk port into one buffer
    (``out`` when given: returned, holding the tensor; see ``Cluster.get``);
    ``result_of``: the op whose result this reads back (the worker refuses another).

    ``progress(nbytes)``, called once the size is known (not for inline data),
    gives what to advance by the bytes as they arrive.

    Raises:
        NotFound: the worker holds no tensor under ``name``.
        CollectiveError: the call failed, or the connection broke (Unavailable).
    """
    what = f"GetTensorBulk {name!r} from {endpoint.address}"
    deadline = time.monotonic() + timeout
    try:
        response = endpoint.stub.GetTensorBulk(
            worker_pb2.GetTensorBulkRequest(name=name, consume=consume, result_of=result_of),
            timeout=max(timeout, 0.001),
        )
    except grpc.RpcError as err:
        raise _from_rpc_error(err, what) from None
    except ValueError as err:
        if not channel_was_closed(err):
            raise
        raise closed_handle(what) from None
    try:
        meta = codec.check_header(response.header)
    except InvalidArgument as err:
        raise error_for_code(
            grpc.StatusCode.INTERNAL, f"{what}: malformed header: {err.message}"
        ) from None
    if out is not None:
        try:
            codec.check_out(out, meta)
        except codec.OutMismatch:
            if response.ticket:  # present it and hang up: the worker drops it at once
                with contextlib.suppress(CollectiveError, OSError):
                    _connect(endpoint, port, response.ticket, 1.0).close()
            raise
    if not response.ticket:
        if len(response.inline_data) != meta.nbytes:
            raise error_for_code(
                grpc.StatusCode.INTERNAL,
                f"{what}: {len(response.inline_data)} inline bytes for a {meta.nbytes}-byte tensor",
            )
        if out is None:
            return codec.tensor_from_bytes(response.inline_data, meta)
        if meta.nbytes:
            codec.tensor_memoryview(out)[:] = response.inline_data
        return out
    buffer = empty_bytes(meta.nbytes) if out is None else out
    view = codec.tensor_memoryview(buffer)
    got = 0
    sock = _connect(endpoint, port, response.ticket, time_left(deadline, what))
    bar = progress(meta.nbytes) if progress is not None else None
    with contextlib.ExitStack() as unless_kept:
        unless_kept.callback(sock.close)
        try:
            while got < meta.nbytes:
                sock.settimeout(_left(deadline, what, got, meta.nbytes))
                n = sock.recv_into(view[got:])
                if n == 0:
                    break
                got += n
                if bar is not None:
                    bar.advance(n)
        except DeadlineExceeded:
            raise
        except TimeoutError:
            raise DeadlineExceeded(
                f"{what}: timed out after {got} of {meta.nbytes} bytes"
            ) from None
        except OSError as exc:
            raise Unavailable(f"{what}: bulk connection failed after {got} bytes: {exc}") from None
        if got == meta.nbytes:
            unless_kept.pop_all()
            endpoint.bulk.keep(sock)
    if got == 0 and not consume:
        raise BulkUnreachable(f"{what}: the bulk port closed the connection before any byte")
    if got != meta.nbytes:
        raise Unavailable(
            f"{what}: the bulk connection closed after {got} of {meta.nbytes} bytes "
            "(the ticket expired, or the worker stopped)"
        )
    return out if out is not None else codec.typed(buffer, meta)
