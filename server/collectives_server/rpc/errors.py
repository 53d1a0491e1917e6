"""The error boundary every servicer of every daemon sits behind.

Two things reach a client from a server that it must never see: grpc's own
``INTERNAL "Exception deserializing request!"`` for bytes that do not decode,
and the text of an unexpected exception (grpc's default is ``UNKNOWN
"Exception calling application: <exception text>"``; our guards used to say
``INTERNAL "internal error: <exception text>"``), which carried file paths,
class names and allocator messages.

:class:`ErrorBoundary` is a server interceptor (installed by
:func:`collectives_server.rpc.server.start_server` after authentication, so a refused
call is never parsed) that rewrites each method handler:

* the request deserializer becomes the identity and the request is parsed
  inside the wrapper: bytes that do not decode are ``INVALID_ARGUMENT
  "<method>: malformed request"``;
* a :class:`~collectives.errors.CollectiveError` escaping a servicer keeps its
  status and message (what servicers already return is unchanged) and gains
  ``google.rpc.Status`` details: an ``ErrorInfo`` with its structured fields
  (op id, generation, kind, tensor, ranks, reason, executed), built by
  :func:`collectives.errors.to_grpc_status` (:func:`abort_with_error`; the
  worker's guard decorators use the same function);
* anything else becomes ``INTERNAL "internal error (id <hex>)"``; the
  exception and its traceback go only to the daemon's log, under that id, so an
  operator can find them from the client's error.

Aborts a servicer made itself (``context.abort``) and errors of a call whose
client is already gone pass through untouched.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from collectives.errors import CollectiveError, InvalidArgument, Reason, to_grpc_status
from collectives_server.rpc.call_context import CallContext

__all__ = [
    "ErrorBoundary",
    "abort_internal",
    "abort_with_error",
    "guard_handler",
    "internal_error_id",
    "is_abort",
]

log = logging.getLogger("collectives_server.rpc.errors")

# Wrapped handlers are cached by identity: registered handlers are the same
# objects on every call. Handlers made per call (refusals) are wrapped each time.
_CACHE_MAX = 1024


def internal_error_id() -> str:
    return secrets.token_hex(6)


def abort_internal(context: CallContext, where: str, exc: BaseException) -> None:
    """Logs ``exc`` with a fresh id and aborts the call with ``INTERNAL`` and only that id."""
    error_id = internal_error_id()
    log.error("internal error (id %s) in %s", error_id, where, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error (id {error_id})")


def abort_with_error(context: CallContext, err: CollectiveError) -> None:
    """Aborts the call with ``err``'s code and message, and its fields (``executed``
    among them: ``no`` for an op that never ran) as an ``ErrorInfo`` in the status details.

    Trailing metadata the call had already set is kept (``abort_with_status``
    replaces it). Raises, like ``context.abort``.
    """
    trailers = getattr(context, "trailing_metadata", None)
    current = trailers() if callable(trailers) else None
    context.abort_with_status(to_grpc_status(err, current))


def is_abort(context: CallContext, exc: BaseException) -> bool:
    """Whether ``exc`` is the one ``context.abort`` raises (the call's status is set)."""
    state = getattr(context, "_state", None)
    if getattr(state, "aborted", False):
        return True
    return type(exc) is Exception and not exc.args  # grpc's abort raises a bare Exception()


def _handle(exc: Exception, context: CallContext, method: str) -> None:
    """Turns ``exc`` into the call's status; always raises."""
    if is_abort(context, exc):
        raise exc
    if isinstance(exc, CollectiveError):
        abort_with_error(context, exc)
    if isinstance(exc, grpc.RpcError) and not context.is_active():
        raise exc  # the client cancelled or went away: there is nobody to tell
    abort_internal(context, method, exc)


def _parser(deserializer: Callable[[bytes], Any] | None, method: str):
    if deserializer is None:
        return None
    rpc = method.rsplit("/", 1)[-1] or "request"

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:  # protobuf's DecodeError, or anything a decoder raises
            raise InvalidArgument(
                f"{rpc}: malformed request (the message does not decode)",
                reason=Reason.MALFORMED_REQUEST,
            ) from None

    return parse


def _parsed(requests: Iterator[bytes], parse: Callable[[bytes], Any]) -> Iterator[Any]:
    for raw in requests:
        yield parse(raw)


def guard_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` behind the boundary (same kind, same response serializer)."""
    parse = _parser(handler.request_deserializer, method)
    serializer = handler.response_serializer

    def request_of(raw):
        return raw if parse is None else parse(raw)

    def requests_of(raws):
        return raws if parse is None else _parsed(raws, parse)

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        def unary_unary(raw, context):
            try:
                return inner_uu(request_of(raw), context)
            except Exception as exc:
                _handle(exc, context, method)

        return grpc.unary_unary_rpc_method_handler(unary_unary, None, serializer)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        def stream_unary(raws, context):
            try:
                return inner_su(requests_of(raws), context)
            except Exception as exc:
                _handle(exc, context, method)

        return grpc.stream_unary_rpc_method_handler(stream_unary, None, serializer)
    streaming = handler.unary_stream or handler.stream_stream
    if getattr(streaming, "experimental_non_blocking", False):
        return _non_blocking(handler, method, request_of, requests_of)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        def unary_stream(raw, context):
            try:
                yield from inner_us(request_of(raw), context)
            except Exception as exc:
                _handle(exc, context, method)

        return grpc.unary_stream_rpc_method_handler(unary_stream, None, serializer)
    inner_ss = handler.stream_stream

    def stream_stream(raws, context):
        try:
            yield from inner_ss(requests_of(raws), context)
        except Exception as exc:
            _handle(exc, context, method)

    return grpc.stream_stream_rpc_method_handler(stream_stream, None, serializer)


def _non_blocking(handler, method: str, request_of, requests_of) -> grpc.RpcMethodHandler:
    """A streaming handler that answers through ``send_response_callback`` instead of
    holding a server thread (grpc's health ``Watch``): wrapped so it stays one."""
    serializer = handler.response_serializer
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        def unary_stream(raw, context, send_response_callback):
            try:
                return inner_us(request_of(raw), context, send_response_callback)
            except Exception as exc:
                _handle(exc, context, method)

        unary_stream.experimental_non_blocking = True  # type: ignore[attr-defined]
        return grpc.unary_stream_rpc_method_handler(unary_stream, None, serializer)
    inner_ss = handler.stream_stream

    def stream_stream(raws, context, send_response_callback):
        try:
            return inner_ss(requests_of(raws), context, send_response_callback)
        except Exception as exc:
            _handle(exc, context, method)

    stream_stream.experimental_non_blocking = True  # type: ignore[attr-defined]
    return grpc.stream_stream_rpc_method_handler(stream_stream, None, serializer)


class ErrorBoundary(grpc.ServerInterceptor):
    """Puts every handler of a server behind :func:`guard_handler`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        cached = self._wrapped.get(id(handler))
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = guard_handler(handler, handler_call_details.method or "")
        with self._lock:
            if len(self._wrapped) < _CACHE_MAX:
                self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped
