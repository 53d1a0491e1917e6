"""Receive buffers that do not pay a page fault per 4 KiB page.

A large ``torch.empty`` is a fresh anonymous mapping; the first write to each
4 KiB page faults into the kernel, which zeroes it, and that costs more than
the copy itself (figures in docs/perf-log.md, "Figures behind the design").
Asking for transparent huge pages on the buffer (``madvise(MADV_HUGEPAGE)``,
what torch itself does for every allocation when ``THP_MEM_ALLOC_ENABLE=1``)
makes one fault per 2 MiB instead: much faster first fills, same memory.

The SDK cannot set ``THP_MEM_ALLOC_ENABLE`` for the user's process (torch reads
it once, at its first large allocation), so the buffers the data plane receives
into are advised here; the worker daemons set the variable for everything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

__all__ = ["empty_bytes", "HUGE_PAGE"]

HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
# Below this the advice is not worth a system call (and covers no whole huge page).
_MIN_ADVISED = 2 * HUGE_PAGE


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks for huge pages on the whole 2 MiB-aligned interior of ``t``'s memory.

    Only useful before the pages are first touched. Returns whether the kernel
    accepted the advice (False off Linux, for small tensors, or where THP is off).
    """
    nbytes = t.numel() * t.element_size()
    if _madvise is None or t.device.type != "cpu" or nbytes < _MIN_ADVISED:
        return False
    start = t.data_ptr()
    first = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    last = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return _madvise(first, last - first, _MADV_HUGEPAGE) == 0


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8`` CPU tensor of ``nbytes``, advised to use huge pages."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(buffer)
    return buffer
