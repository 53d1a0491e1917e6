"""The SDK's one exception hierarchy, and the one place gRPC errors become it.

Every failure a caller can see is a :class:`CollectiveError` carrying the gRPC
status code and the server's message. Subclasses exist so callers can catch
the cases they handle differently (bad arguments, missing tensors, timeouts,
lost workers) without comparing status codes by hand.
"""

from __future__ import annotations

import grpc

__all__ = [
    "CollectiveError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "Unavailable",
    "DeadlineExceeded",
    "ResourceExhausted",
    "PermissionDenied",
    "from_rpc_error",
    "error_for_code",
    "EXECUTED_METADATA_KEY",
]

# Trailing metadata a worker sets on a failed collective: "no" means the op
# never started on any rank, so retrying it (even a reduction) is safe.
EXECUTED_METADATA_KEY = "collectives-executed"


class CollectiveError(Exception):
    """A failed call: ``.code`` is a ``grpc.StatusCode``, ``.message`` the server's text."""

    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        *,
        executed: bool | None = None,
        generation: int | None = None,
    ) -> None:
        self.code: grpc.StatusCode = code if code is not None else self.default_code
        self.message: str = message
        # False: the server says the op never ran (safe to retry); None: unknown.
        self.executed: bool | None = executed
        # The generation a collective was issued for (None: not a collective).
        self.generation: int | None = generation
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code.name}, message={self.message!r})"


class InvalidArgument(CollectiveError, ValueError):
    """A bad name, dtype, shape, rank, group or reduce op (``INVALID_ARGUMENT``)."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CollectiveError, KeyError):
    """An unknown tensor, group or model (``NOT_FOUND``)."""

    default_code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return CollectiveError.__str__(self)


class FailedPrecondition(CollectiveError):
    """The cluster is not formed, or operands disagree across ranks (``FAILED_PRECONDITION``)."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(CollectiveError):
    """A worker was lost, the generation changed, or nothing answers (``UNAVAILABLE``)."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(CollectiveError, TimeoutError):
    """The call or op did not finish in time (``DEADLINE_EXCEEDED``)."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhausted(CollectiveError):
    """Queue full, memory quota, or message too large (``RESOURCE_EXHAUSTED``)."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(CollectiveError):
    """Missing or wrong credentials (``UNAUTHENTICATED`` / ``PERMISSION_DENIED``)."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE: dict[grpc.StatusCode, type[CollectiveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def error_for_code(
    code: grpc.StatusCode, message: str, *, executed: bool | None = None
) -> CollectiveError:
    """Builds the most specific error class for ``code``."""
    cls = _BY_CODE.get(code, CollectiveError)
    return cls(message, code, executed=executed)


def from_rpc_error(err: grpc.RpcError, what: str = "") -> CollectiveError:
    """Converts a ``grpc.RpcError`` into the SDK's hierarchy.

    This is the only place that maps transport errors: ``DEADLINE_EXCEEDED`` and
    ``CANCELLED`` become :class:`DeadlineExceeded`; a server's trailing
    ``collectives-executed: no`` is kept as ``.executed = False``.
    """
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else None
    message = details or str(err)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and what and what not in message:
        message = f"{what}: {message}"
    executed: bool | None = None
    trailers = (
        err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    )
    for key, value in trailers or ():
        if key == EXECUTED_METADATA_KEY:
            executed = value != "no"
    if code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    return error_for_code(code, message, executed=executed)
