"""Giving freed memory back to the system at once.

A partially received tensor that is dropped (a cancelled or failed put) can
sit in a reference cycle through the exception's traceback until a later
cyclic GC: a put whose stream ends early fails in
``TensorAssembler.finish``, and that frame's ``self`` is the assembler and its
buffer; the exception then lives on in gRPC's call state, in a cycle that only
a full collection reaches. Even once freed, glibc may keep large freed chunks
in its heap. :func:`drop_partial` clears the locals of every frame in the
traceback (the file and line stay for the log) and :func:`trim` asks glibc to
return free heap pages (``malloc_trim``; a no-op elsewhere).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import traceback

__all__ = ["trim", "drop_partial"]


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim() -> None:
    """Returns free heap memory to the system (glibc only)."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


def drop_partial(exc: BaseException | None = None) -> None:
    """After a failed transfer: clear the locals of the traceback's frames (they hold the
    buffer), collect what they kept in cycles, and give the memory back."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    gc.collect(0)
    trim()
