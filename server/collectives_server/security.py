"""Server-side security: TLS/mutual TLS credentials and bearer-token authentication.

Kept free of torch so the CLIs can build it while parsing arguments. Used by
:func:`collectives_server.rpc.server.start_server`; see ``docs/security.md``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from collectives.wire.security import check_token

__all__ = ["OPEN_METHOD_PREFIXES", "ServerSecurity", "TokenAuthInterceptor"]

log = logging.getLogger(__name__)

# Methods callable without the token: health checks (load balancers, probes).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class ServerSecurity:
    """TLS and token settings of one server; the default is plaintext, no token."""

    # PEM bytes of the server's certificate chain and key (both or neither).
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    # PEM bytes of the CA(s) client certificates must chain to: mutual TLS.
    tls_client_ca: bytes | None = None
    # Every call (but health) must carry ``authorization: Bearer <token>``.
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key come together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert/--tls-key (mutual TLS is TLS)")
        if self.token is not None:
            check_token(self.token)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def credentials(self) -> grpc.ServerCredentials | None:
        """Server credentials for TLS, None for plaintext."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)],
            root_certificates=self.tls_client_ca,
            require_client_auth=self.tls_client_ca is not None,
        )

    def describe(self) -> str:
        parts = ["mutual TLS" if self.tls_client_ca else "TLS" if self.tls else "plaintext"]
        parts.append("token required" if self.token else "no token")
        return ", ".join(parts)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the right bearer token with UNAUTHENTICATED.

    The refusal happens before the servicer (and before any request message is
    parsed), so a refused call reads and changes nothing. Tokens are compared in
    constant time.
    """

    def __init__(self, token: str, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES) -> None:
        self._token = token.encode()
        self._open = tuple(open_prefixes)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        if method.startswith(self._open):
            return continuation(handler_call_details)
        problem = self._check(handler_call_details.invocation_metadata or ())
        if problem is None:
            return continuation(handler_call_details)
        log.warning("refused %s: %s", method, problem)
        handler = continuation(handler_call_details)
        return _refusal(handler, f"{method}: {problem}")

    def _check(self, metadata: Sequence[Any]) -> str | None:
        values = [m.value for m in metadata if m.key == "authorization"]
        if not values:
            return (
                "missing credentials: this server requires 'authorization: Bearer <token>' "
                "metadata (SDK: connect(..., token=...) or COLLECTIVES_TOKEN)"
            )
        value = values[-1]
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, presented = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return "malformed credentials: expected 'authorization: Bearer <token>'"
        if not hmac.compare_digest(presented.strip().encode("latin-1", "replace"), self._token):
            return "invalid token: the bearer token does not match this server's --token-file"
        return None


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that aborts UNAUTHENTICATED without reading."""

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    request_streaming = handler is not None and handler.request_streaming
    response_streaming = handler is not None and handler.response_streaming
    # No deserializers: a refused request's bytes are never parsed.
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
