"""TLS on the raw-TCP roads (the bulk port and the call lanes on it).

A worker under TLS serves its bulk port over TLS with its gRPC port's
certificate, and asks for a client certificate from the same CA where its gRPC
port does (mutual TLS): the same identity checks as a gRPC call, on a plain
socket. A client whose channel is TLS wraps its bulk connections with the CA and
client certificate of its channel, and checks the worker's certificate against
the host it dials, as gRPC does; it never dials a plaintext bulk port.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile

from collectives.wire.security import ChannelSecurity

__all__ = ["client_context", "server_context"]


def client_context(security: ChannelSecurity) -> ssl.SSLContext | None:
    """The TLS context of a client's bulk connections; None for a plaintext client."""
    if not security.tls:
        return None
    roots = security.root_certificates
    context = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cadata=roots.decode() if roots is not None else None
    )
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if security.certificate_chain is not None and security.private_key is not None:
        _load_chain(context, security.certificate_chain, security.private_key)
    return context


def server_context(
    certificate_chain: bytes, private_key: bytes, client_ca: bytes | None
) -> ssl.SSLContext:
    """The TLS context of a worker's bulk port: its gRPC port's certificate, and a
    client certificate required (from ``client_ca``) when it is given."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, certificate_chain, private_key)
    if client_ca is not None:
        context.load_verify_locations(cadata=client_ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _load_chain(context: ssl.SSLContext, certificate_chain: bytes, private_key: bytes) -> None:
    """``load_cert_chain`` from PEM bytes: Python's ssl reads them only from files,
    so they go to a private directory (mode 0700, files 0600) for the call."""
    with tempfile.TemporaryDirectory(prefix="collectives-tls-") as directory:
        paths = []
        for name, pem in (("chain.pem", certificate_chain), ("key.pem", private_key)):
            path = os.path.join(directory, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with contextlib.closing(os.fdopen(fd, "wb")) as out:
                out.write(pem)
            paths.append(path)
        context.load_cert_chain(paths[0], paths[1])
