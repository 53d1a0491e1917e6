"""Same-host shared-memory segments: where they live, how they are named, how both sides open them.

A segment is a file directly under :data:`SHM_DIR` named
``collectives-<kind>-<pid>-<random>``: ``<kind>`` says who made it for what
(:data:`CLIENT_SEGMENT` for the SDK's pooled segments, :data:`PUT_SEGMENT` for a
one-off put, :data:`WORKER_GET` for the segments a worker writes a get into),
``<pid>`` is the creator's process id. Both sides rely on these names: a worker
writes only into files named :data:`PREFIX` ``*``, the SDK takes over (and
unlinks) only :data:`WORKER_GET` segments, and a starting worker sweeps the
:data:`WORKER_GET` segments of processes that are gone. The SDK's segment pool
is :mod:`collectives.transport.shm`, the worker's side
``collectives_server.worker.rpc.shm_service``.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from typing import TYPE_CHECKING

from collectives.errors import InvalidArgument
from collectives.wire.codec import CheckedHeader, allocate_bytes, tensor_memoryview

if TYPE_CHECKING:
    import torch

__all__ = [
    "available",
    "create_segment",
    "open_checked",
    "read_segment",
    "unlink",
    "write_into",
    "CLIENT_SEGMENT",
    "PREFIX",
    "PUT_SEGMENT",
    "SHM_DIR",
    "WORKER_GET",
    "WORKER_GET_GLOB",
    "creator_pid",
    "is_ours",
    "is_worker_segment",
    "new_path",
]

SHM_DIR = "/dev/shm"
PREFIX = "collectives-"
# The kinds of segment.
CLIENT_SEGMENT = "seg"
PUT_SEGMENT = "put"
WORKER_GET = "get"
# Every worker-created get segment, as a glob pattern.
WORKER_GET_GLOB = os.path.join(SHM_DIR, f"{PREFIX}{WORKER_GET}-*-*")


def new_path(kind: str) -> str:
    """A fresh segment path of ``kind`` for this process (the file is not created)."""
    return os.path.join(SHM_DIR, f"{PREFIX}{kind}-{os.getpid()}-{uuid.uuid4().hex}")


def is_ours(basename: str) -> bool:
    """True for a file name of the ``collectives-*`` family (a worker writes only those)."""
    return basename.startswith(PREFIX)


def is_worker_segment(path: str) -> bool:
    """True for a path shaped like a segment a worker created for a get (safe to unlink)."""
    return os.path.dirname(path) == SHM_DIR and os.path.basename(path).startswith(
        f"{PREFIX}{WORKER_GET}-"
    )


def creator_pid(path: str) -> int | None:
    """The process id in a segment's name; None when the name carries none."""
    parts = os.path.basename(path).split("-")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None


# pread/write move at most this much per system call (Linux caps one at ~2 GiB).
_IO_BYTES = 1 << 30


def available() -> bool:
    """True when ``/dev/shm`` exists and is writable by this process."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def write_into(fd: int, t: torch.Tensor, offset: int = 0) -> None:
    """Writes the bytes of a contiguous CPU tensor into an open segment at ``offset``."""
    view = tensor_memoryview(t)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + _IO_BYTES], offset + done)


def create_segment(t: torch.Tensor, kind: str = PUT_SEGMENT) -> str:
    """Writes the bytes of a contiguous CPU tensor into a new file under ``/dev/shm``.

    The file is created exclusively with mode 0600; the caller must :func:`unlink` it.
    """
    path = new_path(kind)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        write_into(fd, t)
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    return path


def open_checked(path: str, offset: int, nbytes: int, *, write: bool = False) -> int:
    """Opens a peer-named segment after validating it; returns the fd.

    With ``write``, the file must also be named ``collectives-*`` (a worker
    writes only into segments made for this purpose), and is opened read-write.

    Raises:
        InvalidArgument: ``path`` is not an absolute path of a regular file
            directly under ``/dev/shm`` (no links, no subdirectories), the offset
            is negative, or the file is smaller than ``offset + nbytes``.
    """
    if not isinstance(path, str) or not path:
        raise InvalidArgument("shared-memory path is empty")
    if "\x00" in path:
        raise InvalidArgument("shared-memory path contains a NUL byte")
    if offset < 0:
        raise InvalidArgument(f"shared-memory offset {offset} is negative")
    base = os.path.basename(path)
    if os.path.dirname(path) != SHM_DIR or base in ("", ".", ".."):
        raise InvalidArgument(
            f"shared-memory path {path!r} must name a file directly under {SHM_DIR}/"
        )
    if write and not is_ours(base):
        raise InvalidArgument(
            f"shared-memory path {path!r}: a segment to write into must be named {PREFIX}*"
        )
    mode = os.O_RDWR if write else os.O_RDONLY
    try:
        fd = os.open(path, mode | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidArgument(f"cannot open shared-memory path {path!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"shared-memory path {path!r} is not a regular file")
        if info.st_dev != os.stat(SHM_DIR).st_dev:
            raise InvalidArgument(f"shared-memory path {path!r} is not on {SHM_DIR}")
        if info.st_size < offset + nbytes:
            raise InvalidArgument(
                f"shared-memory file {path!r} holds {info.st_size} bytes; "
                f"offset {offset} + {nbytes} bytes needed"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_segment(fd: int, offset: int, meta: CheckedHeader) -> torch.Tensor:
    """Copies ``meta.nbytes`` at ``offset`` of an open segment into a new tensor."""
    buffer = allocate_bytes(meta.nbytes)
    if meta.nbytes:
        view = tensor_memoryview(buffer)
        done = 0
        while done < meta.nbytes:
            n = os.preadv(fd, [view[done : done + _IO_BYTES]], offset + done)
            if n <= 0:
                raise InvalidArgument(
                    f"shared-memory segment ended after {done} of {meta.nbytes} bytes"
                )
            done += n
    return buffer.view(meta.dtype).reshape(meta.shape)


def unlink(path: str) -> None:
    """Removes a segment; a missing file is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
