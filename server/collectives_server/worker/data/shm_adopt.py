"""Client segments a worker keeps stored tensors in (the zero-copy shared-memory put).

A ``PutTensorShm`` with ``hand_over`` gives the worker the client's segment:
instead of reading the bytes into a new tensor (a ``preadv`` into freshly
faulted pages, two thirds of a put's time), the worker maps the file and
stores a tensor *over* it. The client writes nothing into the segment until
the worker gives it back: a segment is held while any tensor or view over it
lives (a finalizer on the buffer the tensors share counts them), and a later
put's response returns the segments the client asks about (``lent``) that are
no longer held. The client's pool then reuses them, so neither side pays for
fresh pages: a put is the client's one copy into tmpfs.

Why mapping is safe here, and only here: a file truncated by its owner while
mapped turns the next access into a ``SIGBUS`` that kills the daemon (the
reason the worker otherwise only ``pread``s client files). The worker adopts a
segment only when the client runs as the worker's own user (peer uid ==
file owner == the worker's euid): such a client can kill or ptrace the worker
anyway, so the mapping gives it nothing new. The SDK never truncates, writes
or reuses a segment it handed over. A worker serving other users (root) keeps
copying with ``preadv``.

The same rule lets a get write into a same-user client's pooled segment
through a mapping (:meth:`AdoptedSegments.copy_into`, a memcpy) instead of
``pwrite``. Mappings are cached by inode (a pool's segments come back again
and again, and a fresh mapping of a 64 MiB file costs ~16k page faults when
touched); a cached mapping whose file is gone, or beyond
:data:`MAX_IDLE_MAPPINGS` unused ones, is unmapped once no tensor lies in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from collectives.wire.codec import CheckedHeader, tensor_memoryview

__all__ = ["AdoptedSegments", "MAX_IDLE_MAPPINGS", "MIN_ADOPT_BYTES"]

# Below this a copy is cheaper than keeping a whole segment for one tensor.
MIN_ADOPT_BYTES = 1 << 20
# Mappings kept for segments that hold no tensor now (their client will hand them over again).
MAX_IDLE_MAPPINGS = 8
# Segments held at once; beyond this the worker copies (each holds a mapping).
MAX_HELD = 1024

_Key = tuple[int, int]  # (st_dev, st_ino)


@dataclass
class _Mapping:
    path: str
    size: int
    map: mmap.mmap
    tensors: int = 0  # live buffers (tensors and their views) over this mapping
    copying: int = 0  # copies into it in flight (copy_into), outside the lock

    @property
    def idle(self) -> bool:
        """Nothing lies in it or is being written into it: it may be unmapped."""
        return self.tensors == 0 and self.copying == 0


class AdoptedSegments:
    """The client segments this worker maps, and which of them hold stored tensors."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: OrderedDict[_Key, _Mapping] = OrderedDict()  # least recently used first
        self._paths: dict[str, int] = {}  # path -> live buffers over it (only while > 0)
        self._closed = False
        # Buffers freed since the last call. A finalizer may run in any thread at any
        # allocation (the garbage collector), even one holding the lock: it only
        # appends here, and every method applies these first, under the lock.
        self._freed: deque[tuple[_Key, _Mapping]] = deque()

    def eligible(self, uid: int, nbytes: int, file_size: int, offset: int) -> bool:
        """Whether a segment of ``uid`` may be adopted: the worker's own user, a large
        tensor, and a file not much larger than it (its pages stay pinned while held)."""
        with self._lock:
            self._apply_freed_locked()
            held = len(self._paths)
        return (
            uid == os.geteuid()
            and not self._closed
            and nbytes >= MIN_ADOPT_BYTES
            and offset + nbytes <= file_size <= 2 * (offset + nbytes)
            and held < MAX_HELD
        )

    def adopt(self, fd: int, path: str, offset: int, meta: CheckedHeader) -> torch.Tensor:
        """A tensor of ``meta`` over bytes ``[offset, offset + nbytes)`` of the open
        segment ``fd`` (opened read-write); the segment is held until it is freed."""
        with self._lock:
            self._apply_freed_locked()
            key, mapping = self._mapping_locked(fd, path, offset + meta.nbytes)
            # A ctypes array over the mapping: every tensor and view over it keeps it
            # alive, and its finalizer gives the segment back.
            window = (ctypes.c_ubyte * meta.nbytes).from_buffer(mapping.map, offset)
            mapping.tensors += 1
            self._paths[path] = self._paths.get(path, 0) + 1
            weakref.finalize(window, self._freed.append, (key, mapping))
        return torch.frombuffer(window, dtype=torch.uint8).view(meta.dtype).reshape(meta.shape)

    def copy_into(self, fd: int, path: str, offset: int, wire: torch.Tensor) -> None:
        """Copies a contiguous CPU tensor into the open segment ``fd`` (read-write, of
        the worker's own user, at least ``offset + nbytes`` long, holding no stored
        tensor) through its cached mapping: a get into a client's pooled segment at
        memcpy speed, about twice ``pwrite``'s into tmpfs. Safe for the reason
        :meth:`adopt` is."""
        nbytes = wire.numel() * wire.element_size()
        if nbytes == 0:
            return
        with self._lock:
            self._apply_freed_locked()
            key, mapping = self._mapping_locked(fd, path, offset + nbytes)
            target = torch.frombuffer(mapping.map, dtype=torch.uint8, count=nbytes, offset=offset)
            # The copy runs outside the lock: until it ends, nothing may unmap this
            # mapping (the reaper finds the client's name gone when the client gave the
            # call up; the copy's threads would write into unmapped memory).
            mapping.copying += 1
        try:
            target.copy_(torch.frombuffer(tensor_memoryview(wire), dtype=torch.uint8))
        finally:
            del target
            with self._lock:
                mapping.copying -= 1
                if mapping.idle and self._maps.get(key) is not mapping:
                    _close(mapping)  # dropped from the cache while the copy ran

    def _mapping_locked(self, fd: int, path: str, end: int) -> tuple[_Key, _Mapping]:
        """The cached mapping of the open file ``fd`` covering ``[0, end)``; made (or
        remade, when the file grew) if needed."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        mapping = self._maps.get(key)
        if mapping is None or mapping.size < end or mapping.path != path:
            # Writable: stored tensors may be updated in place by the worker's ops.
            mapping = _Mapping(path, info.st_size, mmap.mmap(fd, info.st_size))
            stale = self._maps.pop(key, None)
            if stale is not None and stale.idle:
                _close(stale)
            self._maps[key] = mapping
        self._maps.move_to_end(key)
        self._trim_locked()
        return key, mapping

    def holds_inode(self, fd: int) -> bool:
        """True when the open file ``fd`` is a segment holding a stored tensor."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        with self._lock:
            self._apply_freed_locked()
            mapping = self._maps.get(key)
            return mapping is not None and mapping.tensors > 0

    def returned(self, lent: list[str]) -> list[str]:
        """Those of ``lent`` that hold no tensor (any more): the client may reuse them."""
        with self._lock:
            self._apply_freed_locked()
            return [path for path in lent if path not in self._paths]

    def _apply_freed_locked(self) -> None:
        """Gives back the segments whose last buffer was freed."""
        while self._freed:
            key, mapping = self._freed.popleft()
            mapping.tensors -= 1
            left = self._paths.pop(mapping.path, 1) - 1
            if left > 0:
                self._paths[mapping.path] = left
            if not mapping.idle:
                continue  # more buffers, or a copy whose end closes it if dropped
            current = self._maps.get(key) is mapping
            if current and not self._closed and _exists(mapping, key):
                continue  # kept: the client will hand this segment over again
            if current:
                del self._maps[key]
            _close(mapping)
        self._trim_locked()

    def _trim_locked(self) -> None:
        idle = [k for k, m in self._maps.items() if m.idle]
        for key in idle[: max(0, len(idle) - MAX_IDLE_MAPPINGS)]:
            _close(self._maps.pop(key))

    def reap(self) -> int:
        """Unmaps idle mappings whose file was unlinked (its client closed); how many."""
        with self._lock:
            self._apply_freed_locked()
            gone = [k for k, m in self._maps.items() if m.idle and not _exists(m, k)]
            for key in gone:
                _close(self._maps.pop(key))
            self._trim_locked()
        return len(gone)

    def close(self) -> None:
        """Unmaps every idle mapping; those holding tensors go when their tensors do."""
        with self._lock:
            self._closed = True
            self._apply_freed_locked()
            idle = [k for k, m in self._maps.items() if m.idle]
            for key in idle:
                _close(self._maps.pop(key))

    @property
    def counts(self) -> tuple[int, int]:
        """(segments holding tensors, mappings cached)."""
        with self._lock:
            self._apply_freed_locked()
            return len(self._paths), len(self._maps)


def _exists(mapping: _Mapping, key: _Key) -> bool:
    """Whether the segment's name still names the mapped file (else no client can
    hand it over again)."""
    try:
        info = os.stat(mapping.path, follow_symlinks=False)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == key


def _close(mapping: _Mapping) -> None:
    # A buffer over it may still be alive (a finalizer runs before the buffer is
    # let go): then the mapping goes when its last reference does.
    with contextlib.suppress(BufferError):
        mapping.map.close()
