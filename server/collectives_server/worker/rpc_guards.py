"""Decorators that turn domain errors into gRPC statuses and count each RPC.

Every servicer method is wrapped: ``CollectiveError`` becomes its status code
and message (with ``collectives-executed: no`` trailing metadata for ops that
never started), anything unexpected becomes ``INTERNAL`` with only an error id
(details in the log; see :mod:`collectives_server.rpc_errors`) without taking the
worker down, and ``_counted`` records the outcome and latency in the worker's
status and metrics.
"""

from __future__ import annotations

import inspect
import time

import grpc

from collectives.errors import EXECUTED_METADATA_KEY, CollectiveError
from collectives_server.rpc_errors import abort_internal, is_abort
from collectives_server.worker.status import data_op_done

__all__ = ["abort", "guard", "guard_stream", "counted"]


def abort(context: grpc.ServicerContext, err: CollectiveError) -> None:
    if err.executed is False:
        context.set_trailing_metadata(((EXECUTED_METADATA_KEY, "no"),))
    context.abort(err.code, err.message)


def guard(method):
    """Turns SDK-style errors into gRPC statuses; unexpected ones into INTERNAL."""

    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except CollectiveError as err:
            abort(context, err)
        except Exception as exc:
            if isinstance(exc, grpc.RpcError) or is_abort(context, exc):
                raise
            abort_internal(context, method.__name__, exc)

    wrapper.__name__ = method.__name__
    return wrapper


def guard_stream(method):
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except CollectiveError as err:
            abort(context, err)

    wrapper.__name__ = method.__name__
    return wrapper


def _subject(request: object) -> str:
    """The tensor or model a request is about, for op records and logs."""
    return getattr(request, "name", "") or getattr(request, "model", "")


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
            except CollectiveError as err:
                code, message = err.code, err.message
                raise
            except Exception:
                code, message = grpc.StatusCode.INTERNAL, "internal error (see the worker's log)"
                raise
            finally:
                name = name or _subject(request)
                data_op_done(self._ctx, kind, name, code, message, time.perf_counter() - started)

        def stream(self, request, context):
            started, code, message = time.perf_counter(), None, ""
            try:
                yield from method(self, request, context)
            except CollectiveError as err:
                code, message = err.code, err.message
                raise
            except GeneratorExit:
                code, message = grpc.StatusCode.CANCELLED, "the client cancelled the stream"
                raise
            except Exception:
                code, message = grpc.StatusCode.INTERNAL, "internal error (see the worker's log)"
                raise
            finally:
                latency_s = time.perf_counter() - started
                data_op_done(self._ctx, kind, _subject(request), code, message, latency_s)

        wrapper = stream if inspect.isgeneratorfunction(method) else unary
        wrapper.__name__ = method.__name__
        return wrapper

    return decorate
