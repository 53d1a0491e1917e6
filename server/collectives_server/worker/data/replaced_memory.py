"""Memory of values the worker just replaced, kept for its next value of that size.

Every put and every collective result lands in memory of its own, and the
first write to each 4 KiB page of a fresh mapping faults into the kernel,
which zeroes it: filling fresh memory costs several times what filling memory
already touched does (figures in docs/perf-log.md). Clients that keep weights current put
tensors of the same size under the same names again and again, and in-place
collectives replace each operand with a result of its size, so the value a
put or an op replaces is, byte for byte, the memory the next one needs.

One pool per worker serves both: a put receives into it (:meth:`take`) and an
op's result is allocated from it (:meth:`empty`), and both offer it the value
they replaced (:meth:`offer`), so memory flows between them (a replicated
put's upload on the leader replaces the previous upload; a broadcast result on
a follower replaces the previous result).

A replaced value is kept only when nothing else can still see it (see
:func:`~collectives_server.worker.data.buffers.reusable`: no other reference,
no view, not a GET or collective in flight), within ``max_buffers`` and
``max_bytes``, and for at most ``idle_s`` unused (:meth:`expire`, called by
the worker's heartbeat loop), after which its memory goes back to the system.
The pool is not part of the store's quota: it holds no data anyone can read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from collectives_server.worker.data.buffers import REUSE_MIN_BYTES, fresh, reusable
from collectives_server.worker.data.memory_release import trim

__all__ = ["ReplacedMemory", "pool_bytes"]


def pool_bytes(limit_bytes: int | None) -> int:
    """The most a worker keeps: 512 MiB, or a quarter of its store's limit if lower."""
    return min(512 << 20, limit_bytes // 4) if limit_bytes else 512 << 20


class ReplacedMemory:
    """Thread-safe: puts arrive on many RPC threads, ops on the generation's thread."""

    def __init__(
        self,
        max_buffers: int = 4,
        max_bytes: int = 512 << 20,
        idle_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_buffers, self.max_bytes, self.idle_s = max_buffers, max_bytes, idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: list[tuple[float, torch.UntypedStorage]] = []  # (kept at, memory), oldest first
        self.puts_reused = 0  # puts received into kept memory (a counter)
        self.results_reused = 0  # op results allocated on kept memory (a counter)

    def offer(self, t: torch.Tensor, refs: int = 1) -> bool:
        """Keeps ``t``'s memory if the caller's ``refs`` references to ``t`` (besides
        the argument) are all there are; the caller then drops them. True if kept."""
        # +1: this frame's own reference (the argument) on top of the caller's.
        if not reusable(t, refs + 1, self.max_bytes):
            return False
        storage = t.untyped_storage()
        with self._lock:
            self._kept.append((self._clock(), storage))
            while len(self._kept) > self.max_buffers or self._bytes() > self.max_bytes:
                self._kept.pop(0)
        return True

    def _pop(self, nbytes: int, for_put: bool) -> torch.UntypedStorage | None:
        with self._lock:  # the counters too: puts come from many threads at once
            for i in range(len(self._kept) - 1, -1, -1):  # newest first
                if self._kept[i][1].nbytes() == nbytes:
                    if for_put:
                        self.puts_reused += 1
                    else:
                        self.results_reused += 1
                    return self._kept.pop(i)[1]
        return None

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A ``uint8`` tensor of ``nbytes`` on kept memory, or None (a put's buffer)."""
        storage = self._pop(nbytes, for_put=True)
        if storage is None:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor (an op's result), on kept memory of exactly its size
        when there is one."""
        shape = tuple(shape)
        if device.type == "cpu":
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            storage = self._pop(nbytes, for_put=False) if nbytes >= REUSE_MIN_BYTES else None
            if storage is not None:
                return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        return fresh(shape, dtype, device)

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

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        return sum(s.nbytes() for _, s in self._kept)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
