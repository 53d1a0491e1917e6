"""Which road a call or a tensor takes between the SDK and a worker, decided here.

* **A tensor's bytes** (:func:`choose_path`): shared memory (same host, opted
  in), the worker's bulk port (raw TCP, or TLS on a TLS worker: at least
  ``BULK_MIN_BYTES``, and any get), else the gRPC stream.
* **A forward's or backward's tensors** (:data:`INLINE_BYTES`,
  :class:`InlineBudget`): inside the call's message up to a budget per call and
  direction, the rest put before and fetched after by name.
* **A unary call** (``WorkerEndpoint.unary(method)``): a call lane when the
  worker's lanes carry the method (:mod:`collectives.transport.lanes` decides from what the
  worker named, the request's size and whether a lane can be had), else a gRPC
  call.

Call sites name no road: they put, get, and call ``unary(method)``; the roads
give the same answers and errors (``docs/design.md``, "Two roads for one
behaviour").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from collectives.transport.bulk import BulkEndpoint
from collectives.wire.limits import BULK_MIN_BYTES

__all__ = ["INLINE_BYTES", "DataPath", "InlineBudget", "Route", "choose_path"]

# Per call and direction, tensors up to this many bytes in total travel inside
# the Forward/Backward messages instead of a put before and a get after: one
# RPC per worker instead of three (gRPC's 4 MiB message limit leaves room).
INLINE_BYTES = 1 << 20


class InlineBudget:
    """Bytes left for inline tensors in one message."""

    def __init__(self, nbytes: int = INLINE_BYTES) -> None:
        self.left = nbytes

    def take(self, t: torch.Tensor) -> bool:
        """Whether ``t`` travels inline (then counted), else by name."""
        nbytes = t.numel() * t.element_size()
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


class DataPath(enum.Enum):
    """How a tensor's bytes travel between the SDK and a worker."""

    SHM = "shm"  # a /dev/shm segment (same host, opt-in; see collectives.transport.shm)
    BULK = "bulk"  # the worker's bulk port: raw TCP beside gRPC (see collectives.transport.bulk)
    STREAM = "stream"  # 4 MiB chunks on the PutTensor/GetTensor gRPC stream


@dataclass(frozen=True)
class Route:
    """A :class:`DataPath`, with the worker's bulk port for :attr:`DataPath.BULK`."""

    path: DataPath
    bulk_port: int = 0


def choose_path(
    endpoint: BulkEndpoint, timeout: float, *, nbytes: int | None, shared_memory: bool = False
) -> Route:
    """How a put of ``nbytes`` (a get: None, its size is not known yet) travels.

    Shared memory when the caller may use it with this worker (``shared_memory``:
    opted in, same host, not refused, and for a put the payload already in a
    segment); else the worker's bulk port when it has one (asked once per
    channel; none with ``--no-bulk``, of the other kind than this client (TLS or
    plaintext), or while suspended after a refusal) and
    a put holds at least ``BULK_MIN_BYTES``; else the gRPC stream. A path that
    fails before moving a byte falls back to the next one: the caller chooses
    again without ``shared_memory``, and a refused bulk port gives the stream.

    Raises:
        CollectiveError: asking the worker for its bulk port failed.
    """
    if shared_memory:
        return Route(DataPath.SHM)
    if nbytes is None or nbytes >= BULK_MIN_BYTES:
        port = endpoint.bulk.port(endpoint, timeout)
        if port:
            return Route(DataPath.BULK, port)
    return Route(DataPath.STREAM)
