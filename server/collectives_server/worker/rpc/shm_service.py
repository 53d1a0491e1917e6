"""Same-host shared-memory transfers, without a confused deputy.

The worker acts on a ``/dev/shm`` file only when the client could have acted
on it itself:

* ``PutTensorShm`` reads the client's segment only if the file is owned by the
  uid that owns the client's end of the connection (:mod:`peer_identity`); a
  root-only file named by an unprivileged client is PERMISSION_DENIED.
  A segment the client hands over is *adopted* (mapped, the stored tensor lies
  in it, no copy) only when that uid is also the worker's own
  (:mod:`shm_adopt` says why that is no escalation); otherwise it is copied
  out with ``preadv``, never mapped;
* ``GetTensorShm`` writes into a segment the client names only under the same
  rule, so a client cannot overwrite another user's segment: through a
  cached mapping when the client is the worker's own user, else with
  ``pwrite``; otherwise it
  writes a segment it creates for that call (``O_EXCL``, mode 0600, given to
  the peer's uid when the worker runs as root), and never into a segment that
  holds a stored tensor;
* the segments the worker creates are bounded in number and bytes and
  unlinked after a TTL (a client maps or copies them at once; a mapping
  outlives the name), and stale ones of dead workers are swept at start
  (:mod:`shm_segments`), so a crashed worker's segments never fill ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import os

import torch

from collectives.errors import InvalidArgument, PermissionDenied
from collectives.v1 import worker_pb2
from collectives.wire import codec, shm
from collectives.wire.names import validate_name
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.data.shm_adopt import MIN_ADOPT_BYTES
from collectives_server.worker.data.shm_segments import ShmLimits, WorkerSegments
from collectives_server.worker.data.store import result_of
from collectives_server.worker.transport.peer_identity import loopback_peer_uid

__all__ = ["ShmLimits", "WorkerSegments", "get_tensor_shm", "put_tensor_shm"]

# At most this many of a request's lent segments are answered.
_MAX_LENT = 64


def _check_owner(fd: int, uid: int, path: str) -> None:
    owner = os.fstat(fd).st_uid
    if owner != uid:
        raise PermissionDenied(
            f"shared-memory file {path!r} belongs to uid {owner}, not to the client "
            f"(uid {uid}): the worker only uses segments the client owns"
        )


def put_tensor_shm(
    ctx: WorkerContext, request: worker_pb2.PutTensorShmRequest, peer: str
) -> worker_pb2.PutTensorResponse:
    uid = loopback_peer_uid(peer, ctx.port)
    validate_name(request.header.name)
    meta = codec.check_header(request.header)
    ctx.store.check_quota(meta.name, meta.nbytes)
    adopted = ctx.shm_segments.adopted
    fd, writable = _open_put_segment(request, meta.nbytes, uid)
    try:
        _check_owner(fd, uid, request.path)
        size = os.fstat(fd).st_size
        adopt = (
            writable
            and ctx.store.device.type == "cpu"  # else the store copies it to its device
            and adopted.eligible(uid, meta.nbytes, size, request.offset)
        )
        if adopt:
            tensor = adopted.adopt(fd, request.path, request.offset, meta)
        else:
            tensor = shm.read_segment(fd, request.offset, meta)
    finally:
        os.close(fd)
    ctx.store.put(meta.name, tensor)  # frees the tensor it replaces (and its segment)
    del tensor
    ctx.stats.add_bytes(received=meta.nbytes)
    # Kept only if the stored tensor still lies in it (e.g. not replaced meanwhile).
    adopt = adopt and not adopted.returned([request.path])
    lent = list(request.lent[:_MAX_LENT])
    # Only segments of the worker's own user are ever adopted.
    returned = adopted.returned(lent) if uid == os.geteuid() else lent
    return worker_pb2.PutTensorResponse(
        name=meta.name, nbytes=meta.nbytes, adopted=adopt, returned=returned
    )


def _open_put_segment(
    request: worker_pb2.PutTensorShmRequest, nbytes: int, uid: int
) -> tuple[int, bool]:
    """The put's segment, open read-write when it may be adopted (handed over by
    the worker's own user, named ``collectives-*``), else read-only; and which."""
    if request.hand_over and uid == os.geteuid() and shm.is_ours(os.path.basename(request.path)):
        with contextlib.suppress(InvalidArgument):  # e.g. a read-only file: copy it
            return shm.open_checked(request.path, request.offset, nbytes, write=True), True
    return shm.open_checked(request.path, request.offset, nbytes), False


def get_tensor_shm(
    ctx: WorkerContext, request: worker_pb2.GetTensorShmRequest, peer: str
) -> worker_pb2.GetTensorShmResponse:
    uid = loopback_peer_uid(peer, ctx.port)
    validate_name(request.name)
    tensor = ctx.store.get(request.name, result_of(request))
    wire = tensor.detach()
    if wire.device.type != "cpu":
        wire = wire.cpu()
    wire = wire.resolve_conj().resolve_neg().contiguous()
    header = codec.make_header(request.name, wire)
    path = request.path if request.path and _write_into(ctx, request, wire, uid) else ""
    if not path:
        path = ctx.shm_segments.create(wire, uid)
    ctx.stats.add_bytes(sent=header.nbytes)
    if request.consume:
        ctx.store.delete_if_same(request.name, tensor)
    offset = request.offset if path == request.path else 0
    return worker_pb2.GetTensorShmResponse(header=header, path=path, offset=offset)


def _write_into(
    ctx: WorkerContext, request: worker_pb2.GetTensorShmRequest, wire: torch.Tensor, uid: int
) -> bool:
    """Writes into the client's own segment when it is large enough (False: it is not,
    or it is gone); PERMISSION_DENIED when the segment is not the client's."""
    nbytes = wire.numel() * wire.element_size()
    if not os.path.lexists(request.path):
        return False  # e.g. a segment of ours the client adopted, unlinked after its TTL
    fd = shm.open_checked(request.path, request.offset, 0, write=True)
    try:
        _check_owner(fd, uid, request.path)
        if os.fstat(fd).st_size < request.offset + nbytes:
            return False
        if ctx.shm_segments.adopted.holds_inode(fd):
            return False  # it holds a stored tensor: never written behind the store's back
        if uid == os.geteuid() and nbytes >= MIN_ADOPT_BYTES:
            # The worker's own user: through a cached mapping, at memcpy speed (~2x pwrite).
            ctx.shm_segments.adopted.copy_into(fd, request.path, request.offset, wire)
        else:
            shm.write_into(fd, wire, request.offset)  # never map another user's file
        return True
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
