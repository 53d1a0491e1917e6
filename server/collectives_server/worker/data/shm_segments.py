"""The ``/dev/shm`` segments a worker creates for clients' gets: bounded, reaped after a TTL.

A client maps or copies a segment at once (a mapping outlives the name), so
each one is unlinked after ``ShmLimits.ttl_s``; their number and bytes are
bounded, their bytes count against the store's quota while they exist, and
stale ones of dead workers are swept at start (so crashed workers never fill
``/dev/shm``). It also owns the client
segments the worker adopted for puts (:mod:`shm_adopt`), reaped on the same
beat. Used by :mod:`shm_service`.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from collectives.errors import FailedPrecondition, ResourceExhausted
from collectives.wire import shm
from collectives_server.worker.data.limits import ShmLimits
from collectives_server.worker.data.shm_adopt import AdoptedSegments

__all__ = ["ShmLimits", "WorkerSegments"]

_DEFAULT_LIMITS = ShmLimits()


class WorkerSegments:
    """The ``/dev/shm`` segments this worker created for clients' gets."""

    def __init__(
        self,
        limits: ShmLimits = _DEFAULT_LIMITS,
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
        # Client segments holding stored tensors of same-user puts (zero copy).
        self.adopted = AdoptedSegments()

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
                path = shm.create_segment(wire, shm.WORKER_GET)
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
        self.adopted.reap()
        return len(expired)

    def close(self) -> None:
        with self._lock:
            paths, self._held = list(self._held), OrderedDict()
            holds, self._holds = list(self._holds.values()), {}
        for path in paths:
            shm.unlink(path)
        for hold in holds:
            hold.release()
        self.adopted.close()

    @staticmethod
    def sweep_stale() -> int:
        """Unlinks get segments left by workers that are no longer running."""
        removed = 0
        for path in glob.glob(shm.WORKER_GET_GLOB):
            pid = shm.creator_pid(path)
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
