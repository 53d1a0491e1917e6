"""Memory a put just replaced, kept to receive the next put of the same size.

A put lands in a fresh buffer, and the first write to each 4 KiB page of a
fresh mapping faults into the kernel, which zeroes it: on the 2-core VM,
filling a fresh 256 MiB buffer takes ~120 ms against ~35 ms for memory already
touched, most of a 256 MiB put's time at loopback speed. Clients that keep
weights current put tensors of the same size under the same names again and
again, so the value a put replaces is, byte for byte, the buffer the next put
of that size needs.

A replaced value is kept only when nothing else can still see it (see
:func:`~collectives_server.worker.collective_ops.reusable`: no other reference,
no view, not a GET in flight), within ``max_buffers`` and ``max_bytes``, and
for at most ``idle_s`` unused (:meth:`ReceivePool.expire`, called by the
worker's heartbeat loop), after which its memory goes back to the system. The
pool is not part of the store's quota: it holds no data anyone can read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from collectives_server.worker.collective_ops import reusable
from collectives_server.worker.memory_release import trim

__all__ = ["ReceivePool"]


class ReceivePool:
    """Thread-safe: puts arrive on many RPC threads."""

    def __init__(
        self,
        max_buffers: int = 2,
        max_bytes: int = 512 << 20,
        idle_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_buffers, self.max_bytes, self.idle_s = max_buffers, max_bytes, idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: list[tuple[float, torch.UntypedStorage]] = []  # (kept at, memory), oldest first
        self.reused = 0  # puts that landed in kept memory (a counter)

    def offer(self, t: torch.Tensor) -> bool:
        """Keeps ``t``'s memory if the caller's one reference to ``t`` is the only one
        (the caller then drops it); True if kept."""
        if not reusable(t, 2, self.max_bytes):  # the caller's reference and this argument
            return False
        storage = t.untyped_storage()
        with self._lock:
            self._kept.append((self._clock(), storage))
            while len(self._kept) > self.max_buffers or self._bytes() > self.max_bytes:
                self._kept.pop(0)
        return True

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A ``uint8`` tensor of ``nbytes`` on kept memory (newest first), or None."""
        with self._lock:
            for i in range(len(self._kept) - 1, -1, -1):
                if self._kept[i][1].nbytes() == nbytes:
                    _, storage = self._kept.pop(i)
                    self.reused += 1
                    break
            else:
                return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))

    def expire(self) -> int:
        """Drops memory kept longer than ``idle_s`` and gives it back; how many buffers."""
        cutoff = self._clock() - self.idle_s
        with self._lock:
            stale = [s for kept_at, s in self._kept if kept_at <= cutoff]
            self._kept = [(k, s) for k, s in self._kept if k > cutoff]
        dropped = len(stale)
        if dropped:
            del stale  # the last references: the memory is freed here
            trim()
        return dropped

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        return sum(s.nbytes() for _, s in self._kept)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
