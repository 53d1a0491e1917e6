"""``put(name, t)`` on every rank with each byte sent once: the replicated put.

The client puts the tensor once, on the leader (over its bulk port when large),
under an upload name ``__publish/<id>/put``, then calls ``ReplicateTensor``: a
sequenced op in which the leader broadcasts the bytes to every rank over the
process group and every rank stores them under ``name`` at one point of the op
order, or none does (``worker/handlers/replicate_ops.py``). So the client's
egress is the tensor's bytes once, whatever the world size, where parallel
puts to every rank sent them ``world`` times.

Retries follow ``publish``: an attempt that did not run (UNAVAILABLE: the leader
moved or the generation changed; or the leader's queue was full) uploads again,
to whichever worker leads now, and calls again; every failed attempt deletes its
upload, best effort (the leader drops uploads idle for ``UPLOAD_IDLE_S`` anyway).
A put is idempotent, so running it in a later generation than the first attempt
saw is right: it stores on the ranks of the generation it runs in.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import grpc
import torch

from collectives._progress import Progress
from collectives.errors import CollectiveError, Reason
from collectives.session.connection import Session, server_timeout_s
from collectives.transport.endpoints import WorkerEndpoint, put_tensor
from collectives.v1 import worker_pb2
from collectives.wire.names import UPLOAD_PREFIX

__all__ = ["replicate", "REPLICATE_MIN_BYTES", "UseParallelPuts"]

# put(rank=None) of at least this many bytes takes the replicated op. Below it,
# parallel puts answer sooner (one RPC per rank, against an upload plus a
# sequenced op of three control rounds); above it the replicated op, which sends
# world x fewer bytes, wins (docs/engine.md, the put sent once).
REPLICATE_MIN_BYTES = 4 << 20


class UseParallelPuts(Exception):
    """Nothing was stored; the per-rank puts must carry this put instead: the leader
    refused the upload for its quota (the upload sits beside the name's old value
    until the op commits, so a tensor that fits only in place of its old value
    needs the per-rank puts, which count the old value out)."""


def _retryable(err: CollectiveError) -> bool:
    """Not run: the leader moved, the cluster re-formed, or the queue was full."""
    return err.code == grpc.StatusCode.UNAVAILABLE or err.reason == Reason.QUEUE_FULL


def replicate(
    session: Session,
    name: str,
    t: torch.Tensor,
    deadline: float,
    bar: Progress,
) -> worker_pb2.CollectiveResponse:
    """Uploads ``t`` (CPU, wire layout) to the leader once and runs the replicate op.

    Raises:
        UseParallelPuts: the leader refused the upload for its quota (nothing stored).
        CollectiveError: the op failed (ResourceExhausted: some rank's quota; nothing
            was stored anywhere), or the deadline passed.
    """
    what = f"put {name!r}"

    def attempt(remaining: float) -> worker_pb2.CollectiveResponse:
        snapshot = session.leader_snapshot(time.monotonic() + remaining)
        leader = session.endpoint(snapshot.leader_address or "")
        upload = f"{UPLOAD_PREFIX}{uuid.uuid4().hex}/put"
        try:
            try:
                put_tensor(leader, upload, t, deadline - time.monotonic(), progress=bar)
            except CollectiveError as err:
                if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise UseParallelPuts(err.message) from None
                raise
            request = worker_pb2.ReplicateTensorRequest(
                options=worker_pb2.OpOptions(
                    generation=snapshot.generation,
                    timeout_s=server_timeout_s(deadline - time.monotonic()),
                ),
                upload=upload,
                name=name,
            )
            return leader.unary("ReplicateTensor")(request, deadline - time.monotonic(), what)
        except CollectiveError:
            # Not run, or given up on (a timeout): the op, if it still runs, holds
            # what it read; anything left would wait for the leader's expiry.
            _drop_upload(leader, upload)
            raise

    return session.retry(what, deadline, attempt, _retryable)


def _drop_upload(leader: WorkerEndpoint, upload: str) -> None:
    """Best effort: the leader also drops it after ``UPLOAD_IDLE_S``."""
    with contextlib.suppress(CollectiveError):
        leader.unary("DeleteTensor")(
            worker_pb2.DeleteTensorRequest(name=upload, missing_ok=True), 2.0, "drop"
        )
