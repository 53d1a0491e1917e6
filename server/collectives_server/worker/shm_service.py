"""Same-host shared-memory transfers, without a confused deputy (issue 16, H4, H5, L2).

The worker acts on a ``/dev/shm`` file only when the client could have acted
on it itself:

* ``PutTensorShm`` reads the client's segment only if the file is owned by the
  uid that owns the client's end of the connection (:mod:`peer_identity`); a
  root-only file named by an unprivileged client is PERMISSION_DENIED (H4);
* ``GetTensorShm`` writes into a segment the client names only under the same
  rule, so a client cannot overwrite another user's segment (H5); otherwise it
  writes a segment it creates for that call (``O_EXCL``, mode 0600, given to
  the peer's uid when the worker runs as root);
* the segments the worker creates are bounded in number and bytes and
  unlinked after a TTL (a client maps or copies them at once; a mapping
  outlives the name), and stale ones of dead workers are swept at start (L2).
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from collectives import shm
from collectives.errors import FailedPrecondition, PermissionDenied, ResourceExhausted
from collectives.names import validate_name
from collectives.v1 import worker_pb2
from collectives.wire import codec, shm_names
from collectives_server.worker.peer_identity import loopback_peer_uid

__all__ = ["ShmLimits", "WorkerSegments", "get_tensor_shm", "put_tensor_shm"]


@dataclass(frozen=True)
class ShmLimits:
    max_segments: int = 64
    max_bytes: int = 2 << 30
    ttl_s: float = 30.0


class WorkerSegments:
    """The ``/dev/shm`` segments this worker created for clients' gets."""

    def __init__(
        self,
        limits: ShmLimits = ShmLimits(),
        clock: Callable[[], float] = time.monotonic,
        quota: Any = None,
    ) -> None:
        self.limits = limits
        self._clock = clock
        # The store whose quota a segment's bytes count against while it exists.
        self._quota = quota
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[int, float]] = OrderedDict()  # path -> (bytes, expiry)
        self._holds: dict[str, Any] = {}

    @property
    def held(self) -> tuple[int, int]:
        """(segments, bytes) held now."""
        with self._lock:
            return len(self._held), sum(n for n, _ in self._held.values())

    def create(self, wire: torch.Tensor, uid: int) -> str:
        """A new segment holding ``wire``, readable by ``uid``; its path.

        Raises:
            ResourceExhausted: the segment bounds are reached.
            FailedPrecondition: the peer is another user and the worker is not root.
        """
        nbytes = wire.numel() * wire.element_size()
        euid = os.geteuid()
        if uid != euid and euid != 0:
            raise FailedPrecondition(
                "shared memory refused: the client runs as another user than the worker; "
                "use PutTensor/GetTensor"
            )
        self.reap()
        with self._lock:
            count, held = len(self._held), sum(n for n, _ in self._held.values())
            if count >= self.limits.max_segments or held + nbytes > self.limits.max_bytes:
                raise ResourceExhausted(
                    f"the worker holds {count} shared-memory segments ({held} bytes) for clients, "
                    f"its limit (--shm-max-segments {self.limits.max_segments}, --shm-max-bytes "
                    f"{self.limits.max_bytes}); retry in {self.limits.ttl_s:g} s or use GetTensor"
                )
            hold = (
                self._quota.reserve("(shm segment)", nbytes, "shm segment")
                if self._quota is not None
                else None
            )
            try:
                path = shm.create_segment(wire, shm_names.WORKER_GET)
            except BaseException:
                if hold is not None:
                    hold.release()
                raise
            self._held[path] = (nbytes, self._clock() + self.limits.ttl_s)
            if hold is not None:
                self._holds[path] = hold
        if euid == 0 and uid != 0:
            os.chown(path, uid, -1)
        return path

    def reap(self) -> int:
        """Unlinks the segments past their TTL; how many."""
        now = self._clock()
        with self._lock:
            expired = [p for p, (_, expiry) in self._held.items() if expiry <= now]
            for path in expired:
                del self._held[path]
            holds = [self._holds.pop(p) for p in expired if p in self._holds]
        for path in expired:
            shm.unlink(path)
        for hold in holds:
            hold.release()
        return len(expired)

    def close(self) -> None:
        with self._lock:
            paths, self._held = list(self._held), OrderedDict()
            holds, self._holds = list(self._holds.values()), {}
        for path in paths:
            shm.unlink(path)
        for hold in holds:
            hold.release()

    @staticmethod
    def sweep_stale() -> int:
        """Unlinks get segments left by workers that are no longer running."""
        removed = 0
        for path in glob.glob(shm_names.WORKER_GET_GLOB):
            pid = shm_names.creator_pid(path)
            if pid is not None and not _alive(pid):
                shm.unlink(path)
                removed += 1
        return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_owner(fd: int, uid: int, path: str) -> None:
    owner = os.fstat(fd).st_uid
    if owner != uid:
        raise PermissionDenied(
            f"shared-memory file {path!r} belongs to uid {owner}, not to the client "
            f"(uid {uid}): the worker only uses segments the client owns"
        )


def put_tensor_shm(
    daemon, request: worker_pb2.PutTensorShmRequest, peer: str, server_port: int
) -> worker_pb2.PutTensorResponse:
    uid = loopback_peer_uid(peer, server_port)
    validate_name(request.header.name)
    meta = codec.check_header(request.header)
    daemon.store.check_quota(meta.name, meta.nbytes)
    fd = shm.open_checked(request.path, request.offset, meta.nbytes)
    try:
        _check_owner(fd, uid, request.path)
        tensor = shm.read_segment(fd, request.offset, meta)
    finally:
        os.close(fd)
    daemon.store.put(meta.name, tensor)
    daemon.stats.add_bytes(received=meta.nbytes)
    return worker_pb2.PutTensorResponse(name=meta.name, nbytes=meta.nbytes)


def get_tensor_shm(
    daemon,
    segments: WorkerSegments,
    request: worker_pb2.GetTensorShmRequest,
    peer: str,
    server_port: int,
) -> worker_pb2.GetTensorShmResponse:
    uid = loopback_peer_uid(peer, server_port)
    validate_name(request.name)
    tensor = daemon.store.get(request.name)
    wire = tensor.detach()
    if wire.device.type != "cpu":
        wire = wire.cpu()
    wire = wire.resolve_conj().resolve_neg().contiguous()
    header = codec.make_header(request.name, wire)
    path = request.path if request.path and _write_into(request, wire, uid) else ""
    if not path:
        path = segments.create(wire, uid)
    daemon.stats.add_bytes(sent=header.nbytes)
    if request.consume:
        daemon.store.delete_if_same(request.name, tensor)
    offset = request.offset if path == request.path else 0
    return worker_pb2.GetTensorShmResponse(header=header, path=path, offset=offset)


def _write_into(request: worker_pb2.GetTensorShmRequest, wire: torch.Tensor, uid: int) -> bool:
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
        shm.write_into(fd, wire, request.offset)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
