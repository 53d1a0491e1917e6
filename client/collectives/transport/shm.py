"""Same-host shared-memory segments for the data plane's fast path.

Like Triton's system shared memory: the payload goes through a file in
``/dev/shm`` (tmpfs, i.e. RAM), and only a handle (path, offset, header) goes
over gRPC. The SDK maps its *own* segments (created 0600 under a random name,
never truncated while mapped) and copies with ``Tensor.copy_``, which runs at
memcpy speed, well above what ``write(2)`` into tmpfs manages; the mapping
lives as long as the segment.

The copies: a put is the SDK's one copy into a pooled segment. Put to one
worker, the segment is *handed over* (:meth:`SegmentPool.hand_over`): a worker
running as this same user keeps the stored tensor in it (maps it; no copy)
and returns it once that tensor is gone; any other worker copies it out with
``preadv``. A get is the worker's one copy into a segment of the pool (through
a mapping for its own user, else ``pwrite``), and the SDK returns a tensor
over it (no copy). A worker maps a client's file
only when the client is its own user: a file truncated while mapped is a
``SIGBUS`` that kills the daemon, which only that user could cause anyway;
for other users it uses ``pread``/``pwrite`` (a truncation is a short read).

Lifetime: a segment belongs to whoever created it, who unlinks it: the SDK
keeps its segments in a :class:`SegmentPool` (reused between calls, so tmpfs
pages are allocated once, not per call; unlinked when the ``Cluster`` closes,
and at exit; a segment whose call failed unanswered is unlinked at once, never
reused, as its worker may still be copying), and takes over the segments a
worker created for a get (the response hands them over). A get returns a tensor
*over* the segment the worker wrote (zero copies on the client, like Triton's
output regions); the segment returns to the pool when that tensor and every
view of it are freed. A segment handed over to a worker stays out of the pool
until a later put's response returns it; closing the pool unlinks it (the
worker's mapping keeps the bytes of a tensor stored in it).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Iterable

import torch

from collectives.errors import InvalidArgument
from collectives.wire.codec import CheckedHeader, tensor_memoryview
from collectives.wire.memory import empty_bytes
from collectives.wire.shm import (
    CLIENT_SEGMENT,
    available,
    new_path,
    unlink,
)

__all__ = [
    "Segment",
    "SegmentPool",
    "available",
]

# Handing a segment over to a worker (see SegmentPool.hand_over): at most this
# many per worker at once, for tensors of at least this many bytes (smaller
# ones are cheaper to copy than to keep a segment for).
MAX_HANDED_OVER = 2
HAND_OVER_MIN_BYTES = 1 << 20


class Segment:
    """A client-owned file under ``/dev/shm`` kept open (and mapped) for reuse."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        # The worker (address) this segment is handed over to: a stored tensor may
        # lie in it, so nothing writes into it, truncates it or reuses it until
        # that worker gives it back (see SegmentPool.hand_over).
        self.holder: str | None = None
        # False when ``path`` no longer names this file (so the segment is never
        # handed to a worker again, nor unlinked by us): used once, then dropped.
        self.named = True
        # False once a call failed without the worker's answer: the worker may
        # still copy into or out of it, so it is destroyed when released.
        self.reusable = True
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None  # uint8 view of the whole mapping

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size if self.fd >= 0 else 0

    def _mapped(self, end: int) -> torch.Tensor:
        """A uint8 tensor over the file's first ``size`` bytes (remapped after it grew)."""
        if self._bytes is None or self._bytes.numel() < end:
            self.unmap()
            size = self.size
            if size < end:
                raise InvalidArgument(f"segment holds {size} bytes; {end} needed")
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        return self._bytes

    def unmap(self) -> None:
        """Drops this process's mapping (the file stays; the next access maps it again)."""
        self._bytes = None
        mapping, self._map = self._map, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it
                mapping.close()

    def write(self, t: torch.Tensor, offset: int = 0) -> None:
        """Copies a contiguous CPU tensor's bytes into the segment at ``offset``."""
        nbytes = t.numel() * t.element_size()
        if nbytes:
            src = torch.frombuffer(tensor_memoryview(t), dtype=torch.uint8)
            self._mapped(offset + nbytes)[offset : offset + nbytes].copy_(src)

    def lend(self, pool: SegmentPool, offset: int, meta: CheckedHeader) -> torch.Tensor:
        """A tensor over the segment's bytes at ``offset`` (no copy); the segment
        goes back to ``pool`` when the last tensor or view over it is freed.

        Until then nothing else writes into it: the pool lends out only free
        segments, and a worker writes only into the segment a get lends it.
        """
        if meta.nbytes == 0:
            pool.release(self)
            return torch.empty(meta.shape, dtype=meta.dtype)
        self._mapped(offset + meta.nbytes)
        assert self._map is not None
        # A ctypes array over the mapping: it keeps the mapping alive, the tensor's
        # storage keeps it alive, and its finalizer returns the segment.
        window = (ctypes.c_ubyte * meta.nbytes).from_buffer(self._map, offset)
        weakref.finalize(window, pool.release, self)
        return torch.frombuffer(window, dtype=torch.uint8).view(meta.dtype).reshape(meta.shape)

    def read(self, offset: int, meta: CheckedHeader) -> torch.Tensor:
        """Copies ``meta.nbytes`` at ``offset`` into a new tensor of ``meta``'s dtype and shape."""
        buffer = empty_bytes(meta.nbytes)
        if meta.nbytes:
            buffer.copy_(self._mapped(offset + meta.nbytes)[offset : offset + meta.nbytes])
        return buffer.view(meta.dtype).reshape(meta.shape)

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        path = new_path(CLIENT_SEGMENT)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            unlink(path)
            raise
        return cls(path, fd)

    @classmethod
    def adopt(cls, path: str) -> Segment | None:
        """Takes over a file a worker created for us; None when we cannot write it.

        The file is renamed to one of our own names: the worker unlinks the name
        it made after a TTL, and a pooled segment must keep a name for puts to
        send. When the rename fails (the name is already gone), the segment is
        used for this get only.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        own = new_path(CLIENT_SEGMENT)
        try:
            os.rename(path, own)
        except OSError:
            segment = cls(path, fd)
            segment.named = False
            return segment
        try:
            renamed = os.stat(own, follow_symlinks=False)
            opened = os.fstat(fd)
            ours = (renamed.st_dev, renamed.st_ino) == (opened.st_dev, opened.st_ino)
        except OSError:
            ours = False
        segment = cls(own if ours else path, fd)
        segment.named = ours  # else the name was swapped under us: not ours to keep
        return segment

    def retire(self) -> None:
        """Never pooled again (destroyed when released): a call with this segment
        failed unanswered, and its worker may still read, write or keep it."""
        self.reusable = False

    def forget_name(self) -> None:
        """Unlinks the segment's name, keeping the open file and any mapping: nothing
        can find it again, and its pages go once the last mapping does."""
        if self.named:
            self.named = False
            unlink(self.path)

    def destroy(self) -> None:
        self.unmap()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            if self.named:
                unlink(self.path)


class SegmentPool:
    """Free segments of one client, reused so that tmpfs pages are allocated once.

    ``acquire`` leases a free segment (the smallest big enough, else the largest
    grown, else a new one), so the pool holds about one segment per concurrent call;
    ``release`` returns it, or destroys it when more than ``keep_bytes`` would
    sit idle. ``close`` (and process exit) unlinks every segment.

    A put to one worker may *hand over* its segment (:meth:`hand_over`): a worker
    running as this user then keeps the stored tensor in the segment's pages
    instead of copying them. Such a segment leaves the pool (``release`` skips
    it) until a later put's response says the worker no longer holds it
    (:meth:`take_back`). At most :data:`MAX_HANDED_OVER` segments per worker are
    out at once, so a client storing many tensors makes at most that many new
    segments before its puts copy again.
    """

    def __init__(self, keep_bytes: int = 1 << 30) -> None:
        self._keep = keep_bytes
        self._lock = threading.Lock()
        self._free: list[tuple[int, Segment]] = []
        self._lent: dict[str, dict[str, Segment]] = {}  # worker -> path -> segment handed over
        # Segments leased out and not yet released (a caller, or a tensor lent over one).
        self._leased: dict[int, Segment] = {}
        self._closed = False
        # Unlinks the free segments (and the names of those handed over or leased:
        # a mapping outlives the name) when the pool is closed, collected, or at exit.
        self._finalizer = weakref.finalize(self, _destroy_all, self._free, self._lent, self._leased)

    def acquire(self, nbytes: int | None = None) -> Segment | None:
        """A segment of at least ``nbytes`` (created if none is free); with None,
        the largest free one or None."""
        with self._lock:
            fits = [i for i, (size, _) in enumerate(self._free) if nbytes is None or size >= nbytes]
            if fits:
                key = max if nbytes is None else min
                i = key(fits, key=lambda i: self._free[i][0])
                return self._lease(self._free.pop(i)[1])
            grow = self._free.pop()[1] if self._free and nbytes is not None else None
        if nbytes is None:
            return None
        if grow is not None:  # the largest free one is too small: grow it (pages kept)
            try:
                grow.unmap()
                os.ftruncate(grow.fd, nbytes)
                with self._lock:
                    return self._lease(grow)
            except OSError:
                grow.destroy()
        segment = Segment.create(max(nbytes, 1))
        with self._lock:
            return self._lease(segment)

    def _lease(self, segment: Segment) -> Segment:
        """Notes ``segment`` as leased out (the caller holds the lock)."""
        self._leased[id(segment)] = segment
        return segment

    def hand_over(self, segment: Segment, worker: str, nbytes: int) -> bool:
        """Marks ``segment`` (holding ``nbytes`` for a put to ``worker`` alone) as
        handed over, when worth it: a large tensor, a segment not much larger, and
        fewer than :data:`MAX_HANDED_OVER` segments out with that worker. Returns
        whether it is (already handed over to ``worker``: a retry, True)."""
        if nbytes < HAND_OVER_MIN_BYTES or segment.size > 2 * nbytes:
            return False
        with self._lock:
            if segment.holder is not None:
                return segment.holder == worker
            lent = self._lent.setdefault(worker, {})
            if self._closed or len(lent) >= MAX_HANDED_OVER:
                return False
            lent[segment.path] = segment
            self._leased.pop(id(segment), None)
            segment.holder = worker
        return True

    def handed_over(self, worker: str, but: str = "") -> list[str]:
        """The paths of the segments handed over to ``worker`` (except ``but``)."""
        with self._lock:
            return [path for path in self._lent.get(worker, ()) if path != but]

    def take_back(self, worker: str, paths: Iterable[str], current: Segment | None = None) -> None:
        """``worker`` no longer holds these segments: back to the pool, except
        ``current`` (the caller's lease, which its caller releases)."""
        back = []
        with self._lock:
            lent = self._lent.get(worker, {})
            for path in paths:
                segment = lent.pop(path, None)
                if segment is not None:
                    segment.holder = None
                    if segment is not current:
                        back.append(segment)
        for segment in back:
            self.release(segment)

    def release(self, segment: Segment) -> None:
        """Returns a leased segment; one handed over to a worker stays out of the pool."""
        if segment.holder is not None:
            return
        size = segment.size
        with self._lock:
            self._leased.pop(id(segment), None)
            if self._closed or not segment.named or not segment.reusable:
                evicted = [segment]
            else:
                self._free.append((size, segment))
                self._free.sort(key=lambda entry: entry[0])
                evicted = []
                while sum(s for s, _ in self._free) > self._keep:
                    evicted.append(self._free.pop(0)[1])
        for seg in evicted:
            seg.destroy()

    def discard(self, segment: Segment) -> None:
        """Returns a leased segment that a worker may still read or write, to be
        destroyed instead of pooled: its call failed without an answer (a
        deadline, a cancellation, a lost connection), so the worker may yet run
        it. Back in the pool, the next call's bytes would lie where that late
        copy lands; unlinked, a late worker finds no file, or copies into pages
        nobody uses again. One handed over to a worker is destroyed when it is
        taken back, however that worker's answers say it came back."""
        segment.retire()
        self.release(segment)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._finalizer()


def _destroy_all(
    free: list[tuple[int, Segment]],
    lent: dict[str, dict[str, Segment]],
    leased: dict[int, Segment],
) -> None:
    while free:
        free.pop()[1].destroy()
    while lent:
        for segment in lent.popitem()[1].values():
            segment.destroy()  # the worker's mapping keeps the pages until it drops the tensor
    while leased:
        # Still in a caller's hands (or under a lent tensor): its name goes, its
        # mapping stays until that caller is done; its release then destroys it.
        leased.popitem()[1].forget_name()
