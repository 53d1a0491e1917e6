"""A stored tensor as ``GetTensorBulk`` answers it: its header, then its bytes inline
(small) or a one-time ticket for the bulk port (large), the ticket's bytes counted
against the store's quota until sent or expired. A drain's ``HandoffTensors`` answers
the same way."""

from __future__ import annotations

import torch

from collectives.errors import FailedPrecondition
from collectives.v1 import worker_pb2
from collectives.wire import codec
from collectives.wire.frames import new_token
from collectives.wire.limits import BULK_MIN_BYTES
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.transport.bulk import BulkListener

__all__ = ["host_copy", "tensor_answer"]


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The wire layout of a stored tensor on the host; via pinned memory from a GPU."""
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.resolve_conj().resolve_neg())
        return host
    return codec.wire_tensor(tensor)


def tensor_answer(
    name: str,
    tensor: torch.Tensor,
    store: TensorStore | None,
    bulk: BulkListener | None,
    remaining_s: float,
) -> worker_pb2.GetTensorBulkResponse:
    """``tensor`` (stored under ``name``) answered inline or by a bulk ticket, whose
    bytes count against ``store``'s quota until sent (None: they do not; a handoff's,
    whose tensors the store holds anyway and cannot change).

    Raises:
        FailedPrecondition: it is too large to answer inline and there is no bulk port.
        ResourceExhausted: the ticket's bytes do not fit in the store's quota.
    """
    wire = host_copy(tensor)
    header = codec.make_header(name, wire)
    response = worker_pb2.GetTensorBulkResponse(header=header)
    if header.nbytes < BULK_MIN_BYTES:
        response.inline_data = codec.tensor_memoryview(wire).tobytes()
        return response
    if bulk is None:
        raise FailedPrecondition(
            f"{name!r} ({header.nbytes} bytes) needs the bulk port, and this worker has none "
            "(--no-bulk)"
        )
    ticket = new_token()
    # The ticket's bytes count against the quota until sent or expired: a
    # client cannot pin unbounded memory with tickets it never uses.
    hold = store.reserve(f"{name} (bulk get)", header.nbytes, "get") if store else None
    try:
        ttl = bulk.offer(ticket, wire, remaining_s, hold)
    except BaseException:
        if hold is not None:
            hold.release()
        raise
    response.ticket = ticket
    response.ticket_ttl_s = ttl
    return response
