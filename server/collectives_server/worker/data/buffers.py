"""Buffers a worker computes into: how they are allocated, when one may be reused,
and a copy between two of them that leaves no spinning threads behind.

The layer below the collectives (``kernels``) and the replaced memory
(``replaced_memory``), which both allocate this way.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence

import torch

__all__ = ["Alloc", "REUSE_MIN_BYTES", "copy_into", "fresh", "memmove_ok", "reusable"]

Alloc = Callable[[Sequence[int], torch.dtype, torch.device], torch.Tensor]


def fresh(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors hold ``t``'s storage (None: this torch cannot tell)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata)) - 1  # less the look-up's own reference


REUSE_MIN_BYTES = 1 << 20  # below this, allocations come from the heap and cost nothing


def reusable(t: torch.Tensor, refs: int, max_bytes: int) -> bool:
    """Whether ``t``'s memory may be reused once its callers drop the ``refs``
    references to ``t`` they hold (their locals and arguments): a CPU tensor of
    ``REUSE_MIN_BYTES`` to ``max_bytes`` that owns its whole storage, with no other
    Python reference and no other tensor (view, detach) on that storage."""
    nbytes = t.numel() * t.element_size()
    return not (
        nbytes < REUSE_MIN_BYTES
        or nbytes > max_bytes
        or t.device.type != "cpu"
        or t._base is not None
        or t.requires_grad
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != nbytes
        or sys.getrefcount(t) - 1 - refs != 1  # less getrefcount's own: the caller's t
        or _storage_refs(t) != 1
    )


def memmove_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-dtype, same-size tensors, with one plain memmove on
    contiguous CPU tensors. torch's copy runs in OpenMP threads whose spin-waiting
    afterwards slows the gloo collective that follows on a busy host; memmove
    (which releases the GIL) costs the same as a one-thread copy and leaves no
    spinning threads behind."""
    if memmove_ok(dst) and memmove_ok(src) and dst.dtype == src.dtype:
        nbytes = src.numel() * src.element_size()
        if nbytes and dst.numel() == src.numel():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
            return
        if not nbytes:
            return
    dst.copy_(src.reshape(dst.shape))
