"""The worker's named tensor store.

Tensors live on the worker's device between calls and survive generation
changes. Stored tensors are never mutated in place: every write (put, or a
collective's commit) swaps in a new tensor object, so a reader streaming a
tensor out, or a collective working on a snapshot, never sees a half-written
value, and a failed collective leaves the old value untouched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from collectives.errors import NotFound, ResourceExhausted

__all__ = ["TensorStore", "StoredInfo"]


@dataclass(frozen=True)
class StoredInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    device: str


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TensorStore:
    def __init__(self, device: torch.device, limit_bytes: int | None = None) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self._tensors: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def check_quota(self, name: str, incoming: int) -> None:
        """Raises ResourceExhausted if ``incoming`` bytes under ``name`` would exceed the limit."""
        if self.limit_bytes is None:
            return
        current = self._tensors.get(name)
        after = self._bytes - (_nbytes(current) if current is not None else 0) + incoming
        if after > self.limit_bytes:
            raise ResourceExhausted(
                f"storing {name!r} ({incoming} bytes) would put {after} bytes in this worker's "
                f"store; its limit is {self.limit_bytes}. Delete tensors or raise the limit."
            )

    def put(self, name: str, t: torch.Tensor) -> None:
        """Stores ``t`` (moved to the store's device) under ``name``, replacing any."""
        if t.device != self.device:
            t = t.to(self.device)
        self.put_many({name: t})

    def put_many(self, tensors: dict[str, torch.Tensor], enforce_quota: bool = True) -> None:
        with self._lock:
            for name, t in tensors.items():
                if enforce_quota:
                    self.check_quota(name, _nbytes(t))
            for name, t in tensors.items():
                old = self._tensors.get(name)
                if old is not None:
                    self._bytes -= _nbytes(old)
                self._tensors[name] = t
                self._bytes += _nbytes(t)

    def get(self, name: str) -> torch.Tensor:
        with self._lock:
            t = self._tensors.get(name)
        if t is None:
            raise NotFound(f"tensor {name!r} is not stored on this worker")
        return t

    def peek(self, name: str) -> torch.Tensor | None:
        with self._lock:
            return self._tensors.get(name)

    def delete(self, name: str) -> bool:
        with self._lock:
            t = self._tensors.pop(name, None)
            if t is None:
                return False
            self._bytes -= _nbytes(t)
            return True

    def delete_if_same(self, name: str, t: torch.Tensor) -> bool:
        """Deletes ``name`` only if it still holds ``t`` (not a newer value)."""
        with self._lock:
            if self._tensors.get(name) is not t:
                return False
            del self._tensors[name]
            self._bytes -= _nbytes(t)
            return True

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every tensor whose name starts with ``prefix``; returns how many."""
        with self._lock:
            doomed = [n for n in self._tensors if n.startswith(prefix)]
            for n in doomed:
                self._bytes -= _nbytes(self._tensors.pop(n))
            return len(doomed)

    def infos(self) -> list[StoredInfo]:
        with self._lock:
            items = list(self._tensors.items())
        return [
            StoredInfo(n, t.dtype, tuple(t.shape), _nbytes(t), str(t.device))
            for n, t in sorted(items)
        ]

    def stats(self) -> tuple[int, int]:
        """(tensors held, bytes held)."""
        with self._lock:
            return len(self._tensors), self._bytes
