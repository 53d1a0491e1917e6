"""Client-side channel security: TLS (optionally mutual) and a bearer token.

A :class:`ChannelSecurity` says how to open every channel of one client (the
SDK's coordinator and worker channels, ``collectives status``, a worker
daemon's channel to its coordinator). See ``docs/security.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from collectives.wire.targets import channel_target

__all__ = [
    "ENV_TLS",
    "ENV_TLS_CA",
    "ENV_TLS_CERT",
    "ENV_TLS_KEY",
    "ENV_TOKEN",
    "PLAINTEXT",
    "SETTINGS_PRECEDENCE",
    "ChannelSecurity",
    "read_pem",
    "read_token_file",
]

ENV_TOKEN = "COLLECTIVES_TOKEN"
ENV_TLS_CA = "COLLECTIVES_TLS_CA"
ENV_TLS_CERT = "COLLECTIVES_TLS_CERT"
ENV_TLS_KEY = "COLLECTIVES_TLS_KEY"
ENV_TLS = "COLLECTIVES_TLS"

SETTINGS_PRECEDENCE = """How the SDK picks each security setting of ``collectives.connect``.

Each of ``token``, ``tls_ca``, ``tls_cert``, ``tls_key`` is taken from, first
to last: the keyword argument (if not None), else the environment variable
(``COLLECTIVES_TOKEN``: the token itself; ``COLLECTIVES_TLS_CA``,
``COLLECTIVES_TLS_CERT``, ``COLLECTIVES_TLS_KEY``: paths of PEM files; empty
counts as unset), else nothing. The channel uses TLS when ``tls=True``, or
``tls`` is None and ``COLLECTIVES_TLS`` is ``1``/``true``/``yes``, or any of
``tls_ca``/``tls_cert`` is set; without ``tls_ca`` the system's root CAs
verify the server. ``tls_cert`` and ``tls_key`` (a client certificate, for
servers started with ``--tls-client-ca``) come together. With a token, every
call carries ``authorization: Bearer <token>`` (also over plaintext, where it
travels in the clear: use TLS beyond a trusted network).
"""

_TRUE = {"1", "true", "yes", "on"}


def read_pem(value: str | os.PathLike[str] | bytes, what: str) -> bytes:
    """PEM bytes: ``value`` itself when bytes, else the content of the file it names.

    Raises:
        ValueError: the file cannot be read or holds no PEM block.
    """
    if isinstance(value, bytes):
        data = value
    else:
        try:
            with open(value, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read {what} {os.fspath(value)!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} is not PEM (no '-----BEGIN' line)")
    return data


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token stored in ``path`` (its content, stripped).

    Raises:
        ValueError: unreadable, empty, or not a single printable ASCII word.
    """
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read token file {os.fspath(path)!r}: {exc}") from None
    return check_token(token, f"token file {os.fspath(path)!r}")


def check_token(token: str, what: str = "token") -> str:
    if not token:
        raise ValueError(f"{what} is empty")
    if not all(33 <= ord(c) < 127 for c in token):
        raise ValueError(f"{what} must be printable ASCII without spaces")
    return token


@dataclass(frozen=True)
class ChannelSecurity:
    """How to open a channel: TLS roots and client certificate, bearer token."""

    tls: bool = False
    # PEM bytes; None: the system roots / no client certificate.
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        if not self.tls and (
            self.root_certificates is not None or self.certificate_chain is not None
        ):
            raise ValueError("TLS settings given for a plaintext channel")
        if self.token is not None:
            check_token(self.token)

    @classmethod
    def resolve(
        cls,
        *,
        token: str | None = None,
        tls: bool | None = None,
        tls_ca: str | os.PathLike[str] | bytes | None = None,
        tls_cert: str | os.PathLike[str] | bytes | None = None,
        tls_key: str | os.PathLike[str] | bytes | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ChannelSecurity:
        """Arguments, else environment, else nothing; see :data:`SETTINGS_PRECEDENCE`.

        Raises:
            ValueError: a file cannot be read, or the settings do not fit together.
        """
        env = os.environ if environ is None else environ
        token = token if token is not None else (env.get(ENV_TOKEN) or None)
        tls_ca = tls_ca if tls_ca is not None else (env.get(ENV_TLS_CA) or None)
        tls_cert = tls_cert if tls_cert is not None else (env.get(ENV_TLS_CERT) or None)
        tls_key = tls_key if tls_key is not None else (env.get(ENV_TLS_KEY) or None)
        if tls is None:
            tls = env.get(ENV_TLS, "").strip().lower() in _TRUE or bool(tls_ca or tls_cert)
        if not tls and (tls_ca or tls_cert or tls_key):
            raise ValueError("tls=False contradicts tls_ca/tls_cert/tls_key")
        return cls(
            tls=tls,
            root_certificates=read_pem(tls_ca, "TLS CA file") if tls_ca else None,
            certificate_chain=read_pem(tls_cert, "TLS client certificate") if tls_cert else None,
            private_key=read_pem(tls_key, "TLS client key") if tls_key else None,
            token=token,
        )

    def open_channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
        """A channel to ``address`` (or to the first that answers of a comma-separated
        list, see :mod:`collectives.wire.targets`) with these settings; nothing is sent yet."""
        address, extra = channel_target(address, tls=self.tls)
        options = [*options, *extra]
        if self.tls:
            creds = grpc.ssl_channel_credentials(
                self.root_certificates, self.private_key, self.certificate_chain
            )
            if self.token is not None:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.access_token_call_credentials(self.token)
                )
            return grpc.secure_channel(address, creds, options=list(options))
        channel = grpc.insecure_channel(address, options=list(options))
        if self.token is None:
            return channel
        # gRPC refuses call credentials on insecure channels: add the header per call.
        return grpc.intercept_channel(channel, _BearerToken(self.token))


PLAINTEXT = ChannelSecurity()


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a plaintext channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(  # type: ignore[no-untyped-def]
        self, method, timeout, metadata, credentials, wait_for_ready, compression
    ) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
