"""Coordinator addresses: checked up front, and a refused one reported at once.

``host:port`` (``[v6]:port`` for IPv6) is the only accepted form. A missing
port, a URL (``http://host:port``) or a port out of range is a usage error
before any connection is tried. :func:`refused_within` tells a closed port or
an unknown host from a slow one, so the SDK and the CLI fail in about a second
on a wrong address instead of waiting out their whole timeout;
:func:`other_protocol` tells an HTTP/1 server (a dashboard, a web page) or a
TLS-only port from a plaintext gRPC server in one round trip, and
:func:`not_a_coordinator` names a gRPC server that lacks the coordinator's
service (a worker answers ``GetState``, which names its coordinator).
"""

from __future__ import annotations

import errno
import os
import socket
import time

import grpc

from collectives.errors import InvalidArgument
from collectives.v1 import worker_pb2, worker_pb2_grpc

__all__ = [
    "COORDINATOR_VARIABLE",
    "REFUSED_GRACE_S",
    "coordinator_from_environment",
    "not_a_coordinator",
    "other_protocol",
    "parse_address",
    "parse_addresses",
    "refused_within",
    "resolve_coordinator",
]

# The environment variable that names the coordinator(s) when no address is
# given, to ``collectives.connect()`` and to every ``collectives`` command.
COORDINATOR_VARIABLE = "COLLECTIVES_COORDINATOR"

# How long a refused connection is retried before it is reported: covers a
# coordinator that is just starting, and is the bound on a wrong address.
REFUSED_GRACE_S = 0.5
_PROBE_TIMEOUT_S = 0.25
_PROBE_INTERVAL_S = 0.1
# What a gRPC client says first (RFC 9113, 3.4): an HTTP/1 server answers it with
# an HTTP/1 status line, a TLS server with an alert record, a gRPC server with SETTINGS.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_TLS_RECORD_TYPES = (0x15, 0x16)  # alert, handshake
# Environment variables that make gRPC connect through a proxy.
_PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy", "GRPC_PROXY", "HTTPS_PROXY")


def coordinator_from_environment() -> str | None:
    """The coordinator address(es) in ``COLLECTIVES_COORDINATOR``; None when unset or empty."""
    return os.environ.get(COORDINATOR_VARIABLE) or None


def resolve_coordinator(address: str | None) -> str:
    """``address``, or ``COLLECTIVES_COORDINATOR`` when it is None (argument > environment).

    Raises:
        InvalidArgument: ``address`` is None and the variable is unset or empty.
    """
    if address is not None:
        return address
    from_env = coordinator_from_environment()
    if from_env is None:
        raise InvalidArgument(
            "no coordinator address: pass connect('host:port') or set "
            f"{COORDINATOR_VARIABLE}=host:port (several: h1:p1,h2:p2)"
        )
    return from_env


def parse_address(text: object, what: str = "coordinator address") -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``.

    Raises:
        InvalidArgument: not a ``host:port`` string, with a hint.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument(f"{what} must be a 'host:port' string, got {text!r}")
    address = text.strip()
    if "://" in address:
        raise InvalidArgument(
            f"{what} {address!r} is a URL; give host:port without a scheme "
            f"(e.g. {address.split('://', 1)[1].rstrip('/')!r})"
        )
    if any(c.isspace() for c in address) or "/" in address:
        raise InvalidArgument(f"{what} {address!r} is not host:port")
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
    else:
        host, sep, port_text = address.rpartition(":")
        if ":" in host:
            raise InvalidArgument(
                f"{what} {address!r}: write an IPv6 address in brackets, e.g. '[::1]:50051'"
            )
    if not sep or not host:
        raise InvalidArgument(
            f"{what} {address!r} has no port; give host:port, e.g. '{address}:50051' "
            "(collectives-server prints the address it listens on)"
        )
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgument(f"{what} {address!r}: the port must be a number in 1..65535")
    return host, int(port_text)


def parse_addresses(text: object, what: str = "coordinator address") -> list[tuple[str, int]]:
    """``"h1:p1,h2:p2"`` (one address or several, e.g. an HA coordinator set) →
    ``[(h1, p1), (h2, p2)]``, each checked as :func:`parse_address` does.

    Raises:
        InvalidArgument: an empty list, or an entry that is not ``host:port``.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument(f"{what} must be a 'host:port' string, got {text!r}")
    parts = [part.strip() for part in text.split(",")]
    if any(not part for part in parts):
        raise InvalidArgument(
            f"{what} {text.strip()!r} has an empty entry; separate addresses with single commas"
        )
    return [parse_address(part, what) for part in parts]


def refused_within(address: str, grace_s: float = REFUSED_GRACE_S) -> str | None:
    """Why nothing can listen at ``address`` (every address of a comma-separated list),
    or None if something may (see :func:`_refused_one`)."""
    parts = [part.strip() for part in address.split(",")]
    if len(parts) == 1:
        return _refused_one(parts[0], grace_s)
    reasons = []
    for part in parts:
        reason = _refused_one(part, grace_s / len(parts))
        if reason is None:
            return None
        reasons.append(f"{part}: {reason}")
    return "; ".join(reasons)


def _refused_one(address: str, grace_s: float) -> str | None:
    """Why nothing can listen at ``address``, or None if something may.

    Tries a TCP connection until one succeeds or ``grace_s`` passes. Returns a
    reason only for answers that are certain (connection refused, unknown
    host, unreachable network); a timeout is not certain (a firewall that
    drops packets, a loaded host), so it returns None and the caller's own
    deadline applies.
    """
    host, port = parse_address(address)
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return None  # gRPC dials the proxy, not the address: a direct probe proves nothing
    deadline = time.monotonic() + grace_s
    reason: str | None = None
    for _ in range(1 + int(grace_s / _PROBE_INTERVAL_S)):
        try:
            with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S):
                return None
        except socket.gaierror as exc:
            return f"the host {host!r} does not resolve ({exc.strerror})"
        except ConnectionRefusedError:
            reason = "the connection was refused (nothing listens on that port)"
        except OSError as exc:
            if exc.errno not in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                return None  # a timeout or something else uncertain
            reason = f"the network is unreachable ({exc.strerror})"
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # Backoff between probes of an external process, bounded by the deadline.
        time.sleep(min(_PROBE_INTERVAL_S, left))
    return reason


def other_protocol(address: str, timeout: float) -> str | None:
    """Why the first address of ``address`` is not a plaintext gRPC server, or None.

    Sends the HTTP/2 client preface and reads the first bytes of the answer:
    text (an HTTP/1 status line, or the error page Python's ``http.server``
    sends for an unknown version) means a web server (the coordinator's
    dashboard, a metrics page), a TLS record means the port wants TLS. Anything else,
    silence, or no connection within ``timeout`` is not certain and returns None.
    """
    part = address.split(",")[0].strip()
    host, port = parse_address(part)
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return None
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_HTTP2_PREFACE)
            first = sock.recv(16)
    except OSError:
        return None
    if first and all(32 <= b < 127 or b in b"\t\r\n" for b in first):
        answer = first.decode("ascii").splitlines()[0]
        return (
            f"{part} is an HTTP/1 server (it answered {answer!r}), not a gRPC port: "
            "the coordinator's dashboard and metrics are served over HTTP; give the "
            "coordinator's gRPC address (the first line `collectives-server local` prints)"
        )
    if first[:1] and first[0] in _TLS_RECORD_TYPES and first[1:2] == b"\x03":
        return (
            f"{part} speaks TLS: connect with TLS (connect(tls=True) or tls_ca=, "
            "`--tls`/`--tls-ca`, COLLECTIVES_TLS=1)"
        )
    return None


# Bound on the one GetState asked of whatever answered.
_ASK_TIMEOUT_S = 2.0


def not_a_coordinator(channel: grpc.Channel, address: str, timeout: float) -> str:
    """A sentence naming what serves at ``address`` over ``channel``, which lacks the
    coordinator's service; it asks for at most ``min(timeout, 2 s)``."""
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        state = stub.GetState(worker_pb2.GetStateRequest(), timeout=min(timeout, _ASK_TIMEOUT_S))
    except grpc.RpcError:
        return (
            f"{address} answers gRPC but is not a collectives coordinator (it serves no "
            "collectives.v1.Coordinator); give the address the coordinator prints first"
        )
    where = f"rank {state.rank}" if state.rank >= 0 else "not a member"
    coordinator = (
        f"its coordinator is at {state.coordinator}: connect to that"
        if state.coordinator
        else "connect to its coordinator"
    )
    return (
        f"{address} is a collectives worker ({state.worker_id}, {where}), not a "
        f"coordinator; {coordinator}"
    )
