"""``load_model``'s archive sent once: staged on every rank by a replicated put.

Streaming the torch.export archive to every worker costs the client ``world`` x
its bytes. Instead, for an archive of at least ``REPLICATE_MIN_BYTES`` on two or
more ranks (and no shared memory, as ``put`` decides), the client replicates the
bytes once, as a 1-D uint8 tensor under a reserved name ``__archive/<id>`` on
every rank (``_replicate.replicate``: uploaded to the leader, broadcast among
the workers, committed everywhere or nowhere), then calls LoadModel on each
worker with ``ModelSpec.archive_tensor`` naming it. The worker copies it to the
same temp file streamed chunks would fill, deletes it from its store, and runs
every check of a streamed archive (validation, canary, quotas, model lock).

Ownership of the staged bytes: the worker deletes them once it has read them.
The client deletes the name, best effort, on every rank whose LoadModel did not
succeed (the call may never have reached it, or failed before reading); and the
worker's store drops a staged archive idle for ``UPLOAD_IDLE_S`` in any case
(the client died in between).

Fallbacks to streaming: the replicated put could not run (``UseParallelPuts``:
the leader's quota refused the upload; or some rank's quota refused it:
streaming does not use the tensor store); per rank, a worker where the staged
tensor is absent (NOT_FOUND: it joined after the put).
"""

from __future__ import annotations

import contextlib
import uuid

import grpc
import torch

from collectives._deadlines import time_left
from collectives._progress import NO_PROGRESS, Progress
from collectives.errors import CollectiveError
from collectives.ops.replicate import REPLICATE_MIN_BYTES, UseParallelPuts, replicate
from collectives.session.connection import Session
from collectives.transport.calls import Job
from collectives.transport.endpoints import WorkerEndpoint
from collectives.transport.model_streams import load_model_on
from collectives.v1 import worker_pb2
from collectives.wire.names import ARCHIVE_PREFIX

__all__ = ["stage_archive", "load_staged", "drop_staged", "REPLICATE_MIN_BYTES"]


def stage_archive(
    session: Session,
    archive: bytes,
    world: int,
    use_shm: bool,
    deadline: float,
    bar: Progress = NO_PROGRESS,
) -> str | None:
    """Replicates ``archive`` to every rank under a fresh ``__archive/<id>``; its name,
    or None when the archive should be streamed instead (see the module doc)."""
    if world < 2 or use_shm or len(archive) < REPLICATE_MIN_BYTES:
        return None
    name = f"{ARCHIVE_PREFIX}{uuid.uuid4().hex}"
    # A view on the bytes: no copy (the tensor is only read).
    t = torch.frombuffer(bytearray(archive), dtype=torch.uint8)
    try:
        replicate(session, name, t, deadline, bar)
    except UseParallelPuts:
        return None
    except CollectiveError as err:
        if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None  # some rank's store is full; streamed archives do not use it
        raise
    return name


def load_staged(
    session: Session,
    what: str,
    spec: worker_pb2.ModelSpec,
    archive: bytes,
    staged: str,
    endpoints: dict[int, WorkerEndpoint],
    deadline: float,
) -> dict[int, worker_pb2.LoadModelResponse]:
    """LoadModel on every rank naming the staged archive (a rank without it gets the
    archive streamed); then drops what is left."""
    staged_spec = worker_pb2.ModelSpec()
    staged_spec.CopyFrom(spec)
    staged_spec.archive_tensor = staged
    loaded: set[int] = set()

    def remaining() -> float:
        return time_left(deadline, f"load_model {spec.name!r}")

    def load_on(rank: int, e: WorkerEndpoint) -> worker_pb2.LoadModelResponse:
        try:
            response = load_model_on(e, staged_spec, b"", remaining())
        except CollectiveError as err:
            if not wants_streaming(err):
                raise
            response = load_model_on(e, spec, archive, remaining())
        loaded.add(rank)  # the worker read (and deleted) the staged tensor
        return response

    try:
        return session.fan_out(
            what, {rank: Job(lambda r=rank, e=e: load_on(r, e)) for rank, e in endpoints.items()}
        )
    finally:
        drop_staged(session, [e for r, e in endpoints.items() if r not in loaded], staged)


def wants_streaming(err: CollectiveError) -> bool:
    """A staged LoadModel failed where streaming the archive to that rank would not:
    the staged tensor is absent there (the worker joined after the put)."""
    return err.code == grpc.StatusCode.NOT_FOUND


def drop_staged(session: Session, endpoints: list[WorkerEndpoint], name: str) -> None:
    """Best effort, in parallel: deletes ``name`` on each endpoint (2 s per call)."""
    if not endpoints:
        return

    what = f"delete staged archive {name!r}"
    request = worker_pb2.DeleteTensorRequest(name=name, missing_ok=True)
    with contextlib.suppress(CollectiveError):
        session.fan_out(
            what,
            {
                i: (lambda e=e: e.unary("DeleteTensor").future(request, 2.0, what))
                for i, e in enumerate(endpoints)
            },
        )
