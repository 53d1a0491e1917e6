"""The SDK's one exception hierarchy, and the one place gRPC errors become it.

Every failure a caller can see is a :class:`CollectiveError` carrying the gRPC
status code and the server's message. Subclasses exist so callers can catch
the cases they handle differently (bad arguments, missing tensors, timeouts,
lost workers) without comparing status codes by hand.

Structured fields. Besides ``code`` and ``message`` an error may say which op
failed and where: ``op_id``, ``generation``, ``kind`` (``"all_reduce"``,
``"get"``...), ``tensor`` (tensor or model name), ``ranks`` (the failing
ranks; ``()`` when unknown), ``reason`` (a :class:`Reason`, machine-readable)
and ``executed`` (``False``: the op never started). Unset fields are ``None``.
One rule fills ``executed`` wherever an error is made, on either side: an
error whose reason is one of :data:`NEVER_STARTED` (the op was refused before
any data moved: a missing or mismatched operand, a quota, a full queue, a
cluster not formed...) has ``executed=False`` unless it says otherwise.

On the wire they travel as ``google.rpc.Status`` details: the status carries
the same code and message and one ``google.rpc.ErrorInfo`` (domain
:data:`ERROR_DOMAIN`, ``reason``, string ``metadata`` such as ``op_id: "7"``,
``ranks: "0,2"``, ``executed: "no"``), so clients in any language can read
them. :func:`to_grpc_status` builds it on the server (the error boundary in
``collectives_server.rpc.errors`` calls it); :func:`from_rpc_error` reads it back.

Attaching them, on either side::

    raise error_for_code(code, msg, op_id=7, generation=3, kind="all_reduce",
                         tensor="grad", ranks=(0, 2), reason=Reason.OPERAND_MISSING)
    raise err.with_context(op_id=desc.op_id, generation=gen)  # fills unset fields

:meth:`CollectiveError.with_context` never overwrites a field that is already
set (the innermost layer knows best); assign the attribute to replace one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Self

import grpc
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "CollectiveError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "Unavailable",
    "DeadlineExceeded",
    "ResourceExhausted",
    "PermissionDenied",
    "Reason",
    "annotate",
    "channel_was_closed",
    "closed_handle",
    "from_rpc_error",
    "error_for_code",
    "status_code",
    "to_grpc_status",
    "CHANNEL_CLOSED_DETAILS",
    "ERROR_DOMAIN",
    "NEVER_STARTED",
    "STATUS_DETAILS_METADATA_KEY",
]

# Where gRPC carries a serialized google.rpc.Status (grpcio-status reads it).
STATUS_DETAILS_METADATA_KEY = "grpc-status-details-bin"
# ErrorInfo.domain of every error this service produces.
ERROR_DOMAIN = "collectives.v1"
# What gRPC says of the calls a channel's close() cut short (CANCELLED, these
# details), and in the ValueError of a call made on a closed channel: this
# client's own close(), never a timeout, so never DeadlineExceeded.
CHANNEL_CLOSED_DETAILS = "Channel closed!"
_CLOSED_CHANNEL_TEXT = "closed channel"
# How gRPC words an UNAVAILABLE for a call it never sent: no connection could be made.
_NOT_CONNECTED_DETAILS = "failed to connect to all addresses"
# ErrorInfo.reason when the error has none (reason is required on the wire).
_NO_REASON = "UNSPECIFIED"
# Bounds on what an error puts on the wire: trailers share gRPC's metadata limit.
_MAX_FIELD_CHARS = 256
_MAX_RANKS = 256


class Reason(enum.StrEnum):
    """Machine-readable causes (``err.reason``, ``ErrorInfo.reason``); one place for all.

    A newer server may send a reason not listed here: ``err.reason`` is then
    that string, so compare with ``==`` rather than converting to ``Reason``.
    """

    GENERATION_CHANGED = "GENERATION_CHANGED"  # the membership moved before the op committed
    CLUSTER_NOT_FORMED = "CLUSTER_NOT_FORMED"  # no sealed generation with enough members
    NOT_LEADER = "NOT_LEADER"  # a collective reached a worker that is not rank 0
    OPERAND_MISSING = "OPERAND_MISSING"  # the tensor is absent on some ranks
    OPERAND_MISMATCH = "OPERAND_MISMATCH"  # dtype or shape disagree across ranks
    QUOTA = "QUOTA"  # a tensor-store or model memory quota
    QUEUE_FULL = "QUEUE_FULL"  # the leader's op queue is full
    PEER_LOST = "PEER_LOST"  # a rank was lost while the op ran
    TIMEOUT = "TIMEOUT"  # the op did not finish within its timeout
    MALFORMED_REQUEST = "MALFORMED_REQUEST"  # the request's bytes do not decode
    VERSION_MOVED = "VERSION_MOVED"  # a forward pinned a model version a rank moved past
    VERSIONS_RESIDENT = "VERSIONS_RESIDENT"  # a publish would keep a third version resident
    RESULT_REPLACED = "RESULT_REPLACED"  # an op's result was written over before read back
    MODEL_RELOADED = "MODEL_RELOADED"  # a forward was cut for another load of its model


# Reasons that mean the op was refused before it started on any rank: every
# rank agreed on the refusal before any data moved, so running it again is safe.
NEVER_STARTED = frozenset(
    {
        Reason.CLUSTER_NOT_FORMED,
        Reason.NOT_LEADER,
        Reason.OPERAND_MISSING,
        Reason.OPERAND_MISMATCH,
        Reason.QUOTA,
        Reason.QUEUE_FULL,
        Reason.MALFORMED_REQUEST,
        Reason.VERSION_MOVED,
        Reason.VERSIONS_RESIDENT,
        Reason.MODEL_RELOADED,
    }
)


class CollectiveError(Exception):
    """A failed call: ``.code`` is a ``grpc.StatusCode``, ``.message`` the server's text.

    The structured fields (``op_id``, ``generation``, ``kind``, ``tensor``,
    ``ranks``, ``reason``, ``executed``) are described in the module docstring.
    """

    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        *,
        executed: bool | None = None,
        generation: int | None = None,
        op_id: int | None = None,
        kind: str | None = None,
        tensor: str | None = None,
        ranks: Iterable[int] = (),
        reason: str | None = None,
    ) -> None:
        self.code: grpc.StatusCode = code if code is not None else self.default_code
        self.message: str = message
        # False: the op never ran (safe to retry); None: unknown.
        self.executed: bool | None = executed
        if executed is None and reason in NEVER_STARTED:
            self.executed = False
        # The generation a collective was issued for (None: not a collective).
        self.generation: int | None = generation
        # The op's id in the leader's sequence (worker logs carry it).
        self.op_id: int | None = op_id
        # The op or call kind: "all_reduce", "get", "load_model"...
        self.kind: str | None = kind
        # The tensor or model the call was about.
        self.tensor: str | None = tensor
        # The ranks the failure concerns; () when unknown.
        self.ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        # A Reason's value (or a newer server's reason string); None when unspecified.
        self.reason: str | None = str(reason) if reason else None
        super().__init__(message)

    def fields(self) -> dict[str, Any]:
        """The structured fields, as keyword arguments for the constructor."""
        return {
            "executed": self.executed,
            "generation": self.generation,
            "op_id": self.op_id,
            "kind": self.kind,
            "tensor": self.tensor,
            "ranks": self.ranks,
            "reason": self.reason,
        }

    def with_context(
        self,
        *,
        executed: bool | None = None,
        generation: int | None = None,
        op_id: int | None = None,
        kind: str | None = None,
        tensor: str | None = None,
        ranks: Iterable[int] = (),
        reason: str | None = None,
    ) -> Self:
        """Fills the fields that are still unset from the arguments; returns ``self``.

        ``raise err.with_context(op_id=..., generation=...)`` re-raises the same
        error annotated. A field already set is kept.
        """
        if self.executed is None:
            self.executed = executed
        if self.generation is None:
            self.generation = generation
        if self.op_id is None:
            self.op_id = op_id
        if not self.kind:
            self.kind = kind or None
        if not self.tensor:
            self.tensor = tensor or None
        if not self.ranks:
            self.ranks = tuple(int(r) for r in ranks)
        if not self.reason:
            self.reason = str(reason) if reason else None
        if self.executed is None and self.reason in NEVER_STARTED:
            self.executed = False
        return self

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def __repr__(self) -> str:
        extra = "".join(
            f", {key}={value!r}"
            for key, value in self.fields().items()
            if value is not None and value != ()
        )
        return f"{type(self).__name__}(code={self.code.name}, message={self.message!r}{extra})"


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


_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` whose wire number is ``number``; UNKNOWN for none."""
    return _CODES_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_for_code(
    code: grpc.StatusCode,
    message: str,
    *,
    executed: bool | None = None,
    generation: int | None = None,
    op_id: int | None = None,
    kind: str | None = None,
    tensor: str | None = None,
    ranks: Iterable[int] = (),
    reason: str | None = None,
) -> CollectiveError:
    """Builds the most specific error class for ``code``, with the given fields."""
    cls = _BY_CODE.get(code, CollectiveError)
    return cls(
        message,
        code,
        executed=executed,
        generation=generation,
        op_id=op_id,
        kind=kind,
        tensor=tensor,
        ranks=ranks,
        reason=reason,
    )


def annotate(err: CollectiveError, prefix: str) -> CollectiveError:
    """The same error (class, code, structured fields) with ``prefix: `` before its message."""
    if err.message.startswith(prefix):
        return err
    try:
        return type(err)(f"{prefix}: {err.message}", err.code, **err.fields())
    except TypeError:  # a subclass with another constructor: keep the original
        return err


def from_rpc_error(err: grpc.RpcError, what: str = "") -> CollectiveError:
    """Converts a ``grpc.RpcError`` into the SDK's hierarchy.

    This is the only place that maps transport errors: ``DEADLINE_EXCEEDED`` and
    ``CANCELLED`` become :class:`DeadlineExceeded`, except a call this client's
    own ``close()`` cut short (:func:`closed_handle`: :class:`Unavailable`); the fields of a
    ``google.rpc.ErrorInfo`` in the status details (domain :data:`ERROR_DOMAIN`)
    fill ``op_id``, ``generation``, ``kind``, ``tensor``, ``ranks``, ``reason``
    and ``executed``. Details that do not decode are ignored. An ``UNAVAILABLE`` that
    gRPC raised because no connection could be made (nothing listens: a stopped
    worker) is ``executed=False``: the request was never sent.
    """
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else None
    message = details or str(err)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and what and what not in message:
        message = f"{what}: {message}"
    trailers = (
        err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    )
    fields: dict[str, Any] = {}
    for key, value in trailers or ():
        if key == STATUS_DETAILS_METADATA_KEY and not fields:
            fields = _fields_of_status(value, code, details)
    if code == grpc.StatusCode.CANCELLED:
        if CHANNEL_CLOSED_DETAILS in (details or ""):
            return closed_handle(what)
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    if (
        code == grpc.StatusCode.UNAVAILABLE
        and not fields
        and (details or "").startswith(_NOT_CONNECTED_DETAILS)
    ):
        fields["executed"] = False  # nothing listened: the request never left this client
    return error_for_code(code, message, **fields)


def closed_handle(what: str = "") -> Unavailable:
    """The error of a call that the client's own ``close()`` (from another thread) cut
    short: ``Unavailable``, since nothing timed out and a retry on this handle cannot
    succeed."""
    prefix = f"{what}: " if what else ""
    return Unavailable(
        f"{prefix}the cluster handle was closed (close()) while the call was in flight"
    )


def channel_was_closed(err: BaseException) -> bool:
    """Whether ``err`` is the ``ValueError`` gRPC raises for a call made on a closed
    channel (then raise :func:`closed_handle`)."""
    return isinstance(err, ValueError) and _CLOSED_CHANNEL_TEXT in str(err)


class _Status(NamedTuple):
    """A ``grpc.Status`` for ``context.abort_with_status``."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


class _GrpcStatus(_Status, grpc.Status):
    pass


def to_grpc_status(
    err: CollectiveError, trailing_metadata: Sequence[tuple[str, str | bytes]] | None = None
) -> grpc.Status:
    """The status a server aborts with for ``err``: its code and message, an
    ``ErrorInfo`` in the ``google.rpc.Status`` details, and ``trailing_metadata``
    (what the call had already set; ``abort_with_status`` replaces it) minus any
    older details."""
    info = error_details_pb2.ErrorInfo(
        domain=ERROR_DOMAIN, reason=_bounded(err.reason) or _NO_REASON
    )
    metadata = info.metadata
    if err.op_id is not None:
        metadata["op_id"] = str(int(err.op_id))
    if err.generation is not None:
        metadata["generation"] = str(int(err.generation))
    if err.kind:
        metadata["kind"] = _bounded(err.kind)
    if err.tensor:
        metadata["tensor"] = _bounded(err.tensor)
    if err.ranks:
        metadata["ranks"] = ",".join(str(int(r)) for r in err.ranks[:_MAX_RANKS])
    if err.executed is not None:
        metadata["executed"] = "yes" if err.executed else "no"
    status = status_pb2.Status(code=err.code.value[0], message=err.message)
    status.details.add().Pack(info)
    kept = [
        (key, value) for key, value in trailing_metadata or () if key != STATUS_DETAILS_METADATA_KEY
    ]
    kept.append((STATUS_DETAILS_METADATA_KEY, status.SerializeToString()))
    return _GrpcStatus(err.code, err.message, tuple(kept))


def _bounded(text: str | None) -> str:
    return (text or "")[:_MAX_FIELD_CHARS]


def _fields_of_status(raw: object, code: grpc.StatusCode, details: str | None) -> dict[str, Any]:
    """The ErrorInfo fields of a serialized ``google.rpc.Status``; {} if there are none.

    Like ``grpc_status.rpc_status.from_call``, details whose code or message
    disagree with the call's are not believed.
    """
    try:
        status = status_pb2.Status.FromString(bytes(raw))  # type: ignore[arg-type]
        if status.code != code.value[0] or status.message != (details or ""):
            return {}
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            ours = detail.Is(info.DESCRIPTOR) and detail.Unpack(info)
            if ours and info.domain == ERROR_DOMAIN:
                return _fields_of_info(info)
    except Exception:  # a server that is not ours, or bytes that do not decode
        return {}
    return {}


def _fields_of_info(info: error_details_pb2.ErrorInfo) -> dict[str, Any]:
    meta = info.metadata
    fields: dict[str, Any] = {}
    if info.reason and info.reason != _NO_REASON:
        fields["reason"] = info.reason
    for key in ("op_id", "generation"):
        if key in meta:
            fields[key] = int(meta[key])
    for key in ("kind", "tensor"):
        if meta.get(key):
            fields[key] = meta[key]
    if meta.get("ranks"):
        fields["ranks"] = tuple(int(r) for r in meta["ranks"].split(","))
    if "executed" in meta:
        fields["executed"] = meta["executed"] != "no"
    return fields
