"""``cluster.publish``: a new version of a model's weights, sent once.

The client puts each entry of the state dict once, on the leader (over the bulk
port when large), under ``__publish/<id>/<key>``; one ``PublishModel`` call then
has the workers broadcast the entries among themselves, stage them beside the
live weights and commit them on every rank at one point of the op order. So
the client's egress is the state dict's bytes once, whatever the world size,
and no ``dp(x)`` ever mixes two versions (see ``data_parallel``).

An attempt that fails deletes its uploads (the op, if it still runs, holds what
it read); one that did not run (the leader changed, the cluster re-formed) is
made again on the new leader. The leader drops uploads whose publish never
came after a few minutes anyway (``UPLOAD_IDLE_S`` on the worker).
"""

from __future__ import annotations

import contextlib
import time
import uuid

import grpc
import torch

from collectives._progress import progress
from collectives.errors import CollectiveError, InvalidArgument, Reason
from collectives.session.connection import Session, server_timeout_s
from collectives.transport.endpoints import WorkerEndpoint, put_tensor
from collectives.v1 import worker_pb2
from collectives.wire.names import MAX_NAME_LENGTH, UPLOAD_PREFIX, validate_name

__all__ = ["publish"]

_PREFIX_LENGTH = len(UPLOAD_PREFIX) + 32 + 1


def check_state_dict(state_dict: object) -> dict[str, torch.Tensor]:
    """``state_dict`` as str -> tensor, or InvalidArgument saying what is wrong."""
    if not isinstance(state_dict, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state_dict.items()
    ):
        raise InvalidArgument("state_dict must map str keys to tensors")
    if not state_dict:
        raise InvalidArgument("state_dict is empty: publish at least one entry")
    for key in state_dict:
        validate_name(key, "state dict key")
        if len(key) > MAX_NAME_LENGTH - _PREFIX_LENGTH:
            raise InvalidArgument(
                f"state dict key {key[:64]!r}... is {len(key)} characters; publish takes keys "
                f"of at most {MAX_NAME_LENGTH - _PREFIX_LENGTH}"
            )
    return state_dict


def _retryable(err: CollectiveError) -> bool:
    """Not run: the leader moved, the cluster re-formed, or the queue was full."""
    return err.code == grpc.StatusCode.UNAVAILABLE or err.reason == Reason.QUEUE_FULL


def publish(
    session: Session,
    name: str,
    state_dict: dict[str, torch.Tensor],
    strict: bool,
    cast: bool,
    deadline: float,
) -> worker_pb2.PublishModelResponse:
    """Uploads ``state_dict`` to the leader once and runs the publish op; its response."""
    validate_name(name, "model name")
    entries = {k: v.detach().cpu().contiguous() for k, v in check_state_dict(state_dict).items()}
    what = f"publish {name!r}"
    nbytes = sum(t.numel() * t.element_size() for t in entries.values())

    def attempt(remaining: float) -> worker_pb2.PublishModelResponse:
        snapshot = session.leader_snapshot(time.monotonic() + remaining)
        leader = session.endpoint(snapshot.leader_address or "")
        prefix = f"{UPLOAD_PREFIX}{uuid.uuid4().hex}/"
        try:
            with progress(what, nbytes, session.progress) as bar:
                for key, t in entries.items():
                    left = deadline - time.monotonic()
                    put_tensor(leader, prefix + key, t, left, progress=bar)
            options = worker_pb2.OpOptions(
                generation=snapshot.generation,
                timeout_s=server_timeout_s(deadline - time.monotonic()),
                membership_digest=snapshot.membership_digest,
            )
            request = worker_pb2.PublishModelRequest(
                options=options, model=name, prefix=prefix, strict=strict, cast=cast
            )
            return leader.unary("PublishModel")(request, deadline - time.monotonic(), what)
        except CollectiveError:
            # Not run, or given up on (a timeout): the op, if it still runs, holds
            # what it read; anything left would wait for the leader's expiry.
            _drop_uploads(leader, prefix, list(entries))
            raise

    return session.retry(what, deadline, attempt, _retryable)


def _drop_uploads(leader: WorkerEndpoint, prefix: str, keys: list[str]) -> None:
    """Best effort: the leader also drops them after ``UPLOAD_IDLE_S``."""
    for key in keys:
        with contextlib.suppress(CollectiveError):
            leader.unary("DeleteTensor")(
                worker_pb2.DeleteTensorRequest(name=prefix + key, missing_ok=True), 2.0, "drop"
            )
