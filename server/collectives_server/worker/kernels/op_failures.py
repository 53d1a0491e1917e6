"""Which failures of a data collective mean the process group is broken.

Tearing a group down is expensive for everyone: every client's collectives
stall until the generation is rebuilt (seconds). So only a failure of the
transport or of a peer breaks the group: gloo's connection closed/reset, a
socket error, a timeout waiting for a rank that is gone, torch's
``DistNetworkError``/``DistStoreError``. Everything else is local to the op (a
dtype the backend cannot reduce, a shape torch refuses, an allocation that
fails): the op fails on this rank with a clear status, every rank agrees on the
outcome as for any other failure, and the group stays.

Messages that reach clients are the backend's first line without source paths
or advice, or, for anything not recognised, only an error id with the details
in this worker's log.
"""

from __future__ import annotations

import logging
import re
import secrets

import grpc
import torch.distributed as dist

from collectives.errors import CollectiveError, Reason, Unavailable, error_for_code
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import kind_name, subject

__all__ = [
    "backend_message",
    "is_transport_failure",
    "local_failure",
    "internal_message",
    "worded",
    "lost_with_group",
]

log = logging.getLogger("collectives_server.worker.engine.generation")

# Lower-case fragments of gloo/NCCL/torch errors that mean a peer or the network failed.
_TRANSPORT_MARKERS = (
    "connection closed",
    "connection reset",
    "connection refused",
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket",
    "read error",
    "write error",
    "unhandled system error",
    "remote process",
    "communicator was aborted",
    "nccl error",
)

_SOURCE_PREFIX = re.compile(r"\[/[^\]]*\]\s*")
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.+-]+){2,}(?::\d+)?")
_CLASS_PREFIX = re.compile(r"\b\w*(?:Error|Exception):\s*")

# Backend messages for which a dtype or op is the problem, not the data.
_UNSUPPORTED = (
    "invalid scalar type",
    "does not support",
    "cannot use reduceop",
    "non-integral dtype",
    "can't be cast",
)
_BAD_SHAPE = ("shape", "size", "dimension", "overflow", "numel", "must match")
_NO_MEMORY = ("can't allocate memory", "out of memory", "not enough memory")


def backend_message(exc: BaseException) -> str:
    """The backend's first line, without source paths, class names or boilerplate advice."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    first = _SOURCE_PREFIX.sub("", first).split(" This is typically")[0]
    first = _CLASS_PREFIX.sub("", _PATH.sub("<path>", first))
    first = "".join(c if c.isprintable() else " " for c in first)
    return first[:300].strip() or "the backend reported an error"


def is_transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` from a collective means a peer or the network failed."""
    if isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _TRANSPORT_MARKERS)


def internal_message(where: str, exc: BaseException) -> str:
    """Logs ``exc`` under a fresh id; the message for clients names only the id."""
    error_id = secrets.token_hex(6)
    log.error("internal error (id %s) in %s", error_id, where, exc_info=exc)
    return f"internal error (id {error_id}; see the worker's log)"


def local_failure(exc: BaseException, what: str, dtype=None) -> tuple[grpc.StatusCode, str]:
    """The status and message of an op that failed on this rank without a transport
    failure (``what`` names the op, e.g. ``"all_reduce"``)."""
    text = str(exc).lower()
    if isinstance(exc, MemoryError) or any(m in text for m in _NO_MEMORY):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: out of memory on this worker"
    if any(m in text for m in _UNSUPPORTED):
        described = f" on {str(dtype).removeprefix('torch.')} tensors" if dtype else ""
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what}{described} is not supported by this worker's backend ({backend_message(exc)})",
        )
    if isinstance(exc, (ValueError, TypeError, IndexError, OverflowError)) or (
        isinstance(exc, RuntimeError) and any(m in text for m in _BAD_SHAPE)
    ):
        log.warning("%s failed locally: %r", what, exc)
        return grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {backend_message(exc)}"
    return grpc.StatusCode.FAILED_PRECONDITION, f"{what} failed: {internal_message(what, exc)}"


def worded(
    desc: worker_pb2.OpDescriptor, generation: int, error: CollectiveError
) -> CollectiveError:
    """``error`` as every rank words it, with the op id the worker logs carry (so a
    client's error can be found in them), the generation, the kind and the tensor."""
    fields = error.fields()
    fields.update(op_id=desc.op_id, generation=generation, kind=kind_name(desc.kind))
    fields["tensor"] = fields["tensor"] or subject(desc) or None
    return error_for_code(
        error.code,
        f"op {desc.op_id} ({kind_name(desc.kind)}, generation {generation}): {error.message}",
        **fields,
    )


def lost_with_group(desc: worker_pb2.OpDescriptor, generation: int, why: object) -> Unavailable:
    """The error of an op that was running when its generation's group broke (``why``)."""
    return Unavailable(
        f"op {desc.op_id} ({kind_name(desc.kind)}) failed in generation {generation}: {why}. "
        "A worker was probably lost; the cluster re-forms without it. The op did not "
        "complete; nothing was committed unless every rank agreed it succeeded.",
        generation=generation,
        op_id=desc.op_id,
        kind=kind_name(desc.kind),
        tensor=subject(desc) or None,
        reason=Reason.PEER_LOST,
    )
