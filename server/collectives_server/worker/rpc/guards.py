"""Decorators that turn domain errors into gRPC statuses and count each RPC.

Every servicer method is wrapped: ``CollectiveError`` becomes its status code
and message (with an ``ErrorInfo`` status detail carrying its structured fields,
``executed: no`` for ops that never started,
see :func:`collectives_server.rpc.errors.abort_with_error`; the request's tensor
or model name and the counted call's kind fill the fields left unset), anything
unexpected becomes ``INTERNAL`` with only an error id
(details in the log; see :mod:`collectives_server.rpc.errors`) without taking the
worker down, and ``_counted`` records the outcome and latency in the worker's
status and metrics. Both guards note the calling client (peer and user agent,
``collectives_server.worker.telemetry.clients``) and name it on the error group of a
call that failed.

``INTERNAL`` means a bug of ours, never a client that went away: a call its
client cancelled, or whose deadline passed, is ``CANCELLED`` or
``DEADLINE_EXCEEDED`` in the log, the status and the metrics, with its tensor's
name (:func:`departure`), whatever the handler raised when its stream broke.
"""

from __future__ import annotations

import copy
import inspect
import time

import grpc

from collectives.errors import CollectiveError, DeadlineExceeded, error_for_code
from collectives.wire.names import MAX_NAME_LENGTH
from collectives_server.rpc.call_context import CallContext
from collectives_server.rpc.errors import abort_internal, abort_with_error, is_abort
from collectives_server.worker.status import data_op_done

__all__ = ["abort", "departure", "guard", "guard_stream", "counted"]

_INTERNAL = "internal error (see the worker's log)"


def departure(context: CallContext, tensor: str = "") -> CollectiveError | None:
    """The client's end of the call, if the client ended it: DEADLINE_EXCEEDED once
    its deadline passed (a stream cut off by it may even look half-closed here),
    CANCELLED when it cancelled (or its connection went); None while the call is live."""
    try:
        remaining = context.time_remaining()
        active = context.is_active()
    except Exception:  # a context without these (not a live gRPC call)
        return None
    if active and (remaining is None or remaining > 0):
        return None
    if remaining is not None and remaining <= 0:
        return DeadlineExceeded(
            "the call's deadline passed before the worker finished it", tensor=tensor or None
        )
    return error_for_code(
        grpc.StatusCode.CANCELLED,
        "the client cancelled the call (or its connection closed) before it finished",
        tensor=tensor or None,
    )


def abort(context: CallContext, err: CollectiveError, request: object = None) -> None:
    """Aborts with ``err`` (status details included), naming the request's tensor if unset."""
    abort_with_error(context, _annotated(err, request))


def _caller(servicer: object, context: CallContext) -> str:
    """Notes the call's client in the worker's ``stats.clients``; its label ("" if
    unknown: a servicer without a worker context, a context without a peer)."""
    stats = getattr(getattr(servicer, "_ctx", None), "stats", None)
    try:
        peer, metadata = context.peer(), context.invocation_metadata
    except Exception:  # not a live gRPC call
        return ""
    return stats.clients.seen(peer, metadata) if stats is not None else ""


def _attribute(servicer: object, err: CollectiveError, client: str) -> None:
    """Names ``client`` on the error group of the call's failure."""
    stats = getattr(getattr(servicer, "_ctx", None), "stats", None)
    if stats is not None and client:
        stats.attribute_failure(err.code, err.message, client)


def guard(method):
    """Turns SDK-style errors into gRPC statuses; unexpected ones into INTERNAL."""

    def wrapper(self, request, context):
        client = _caller(self, context)
        try:
            return method(self, request, context)
        except CollectiveError as err:
            _attribute(self, err, client)
            abort(context, err, request)
        except Exception as exc:
            if isinstance(exc, grpc.RpcError) or is_abort(context, exc):
                raise
            gone = departure(context, _named(request))
            if gone is not None:
                abort(context, gone, request)
            abort_internal(context, method.__name__, exc)

    wrapper.__name__ = method.__name__
    return wrapper


def guard_stream(method):
    def wrapper(self, request, context):
        client = _caller(self, context)
        try:
            yield from method(self, request, context)
        except CollectiveError as err:
            _attribute(self, err, client)
            abort(context, err, request)

    wrapper.__name__ = method.__name__
    return wrapper


def _subject(request: object) -> str:
    """The tensor or model a request is about, for op records and logs."""
    header = getattr(request, "header", None)
    return (
        getattr(request, "name", "")
        or getattr(request, "model", "")
        or (getattr(header, "name", "") if header is not None else "")
    )


def _named(request: object) -> str:
    """:func:`_subject` for an error's details: a client-chosen string, so only one
    of a name's length (a longer one is refused by name validation anyway)."""
    subject = _subject(request)
    return subject if isinstance(subject, str) and len(subject) <= MAX_NAME_LENGTH else ""


def _annotated(err: CollectiveError, request: object, kind: str | None = None) -> CollectiveError:
    """A copy of ``err`` (it may be shared by several calls) with the request's
    tensor and the call's kind in the fields it left unset."""
    return copy.copy(err).with_context(kind=kind, tensor=_named(request))


def _counted_failure(context: CallContext, exc: Exception) -> CollectiveError:
    """What a failed call counts as: the client's departure when it went (whatever
    the handler raised as its stream broke), else the domain error as raised, else
    INTERNAL (a bug of ours; the exception itself goes on to the error boundary)."""
    tensor = exc.tensor or "" if isinstance(exc, CollectiveError) else ""
    gone = departure(context, tensor)
    if gone is not None:
        return gone
    if isinstance(exc, CollectiveError):
        return exc
    return error_for_code(grpc.StatusCode.INTERNAL, _INTERNAL)


def _reraise(failure: CollectiveError, exc: Exception, request: object, kind: str) -> None:
    """Raises what the call ends with: ``exc`` itself when it is a bug (INTERNAL),
    else ``failure`` annotated with the request's tensor and the call's kind."""
    if failure.code is grpc.StatusCode.INTERNAL and not isinstance(exc, CollectiveError):
        raise exc
    raise _annotated(failure, request, kind) from (None if failure is exc else exc)


def counted(kind: str):
    """Counts a data-plane call in the worker's status and metrics: outcome and latency.

    The servicer's ``_ctx`` (its :class:`~collectives_server.worker.context.WorkerContext`)
    holds the counters."""

    def decorate(method):
        def unary(self, request, context):
            started, code, message, name = time.perf_counter(), None, "", ""
            try:
                response = method(self, request, context)
                name = getattr(response, "name", "")
                return response
            except Exception as exc:
                failure = _counted_failure(context, exc)
                code, message = failure.code, failure.message
                name = failure.tensor or ""
                _reraise(failure, exc, request, kind)
            finally:
                name = name or _subject(request)
                data_op_done(self._ctx, kind, name, code, message, time.perf_counter() - started)

        def stream(self, request, context):
            started, code, message = time.perf_counter(), None, ""
            try:
                yield from method(self, request, context)
            except GeneratorExit:
                code, message = grpc.StatusCode.CANCELLED, "the client cancelled the stream"
                raise
            except Exception as exc:
                failure = _counted_failure(context, exc)
                code, message = failure.code, failure.message
                _reraise(failure, exc, request, kind)
            finally:
                latency_s = time.perf_counter() - started
                data_op_done(self._ctx, kind, _subject(request), code, message, latency_s)

        wrapper = stream if inspect.isgeneratorfunction(method) else unary
        wrapper.__name__ = method.__name__
        return wrapper

    return decorate
