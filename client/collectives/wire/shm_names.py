"""Where same-host shared-memory segments live and how they are named.

A segment is a file directly under :data:`SHM_DIR` named
``collectives-<kind>-<pid>-<random>``: ``<kind>`` says who made it for what
(:data:`CLIENT_SEGMENT` for the SDK's pooled segments, :data:`PUT_SEGMENT` for a
one-off put, :data:`WORKER_GET` for the segments a worker writes a get into),
``<pid>`` is the creator's process id. Both sides rely on these names: a worker
writes only into files named :data:`PREFIX` ``*``, the SDK takes over (and
unlinks) only :data:`WORKER_GET` segments, and a starting worker sweeps the
:data:`WORKER_GET` segments of processes that are gone. The SDK's segment pool
is :mod:`collectives.shm`, the worker's side ``collectives_server.worker.rpc.shm_service``.
"""

from __future__ import annotations

import os
import uuid

__all__ = [
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
