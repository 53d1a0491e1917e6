"""The worker's registration with the coordinator: worker token, retry key, lease secret.

The worker-only RPCs take two credentials, so that a client cannot act as a
worker (see
the coordinator's ``admission`` module): the worker token, sent as
metadata on Register, Heartbeat, HeartbeatStream and Leave, and the lease secret
Register returns, sent in every Heartbeat and Leave. :func:`register` also sends a
``retry_key`` random per process, so a retry after a lost answer gets the same
id back, and retries ALREADY_EXISTS (a previous process at this address that
died without leaving still holds its lease) until that lease runs out.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc, status_pb2
from collectives_server.control_protocol import FIELD_LIMITS, worker_metadata

__all__ = ["bounded_status", "register", "retry_key"]

log = logging.getLogger(__name__)

# One per worker process: a Register retried by this process carries it. Made on
# first use in each process, never at import: workers forked from one preloaded
# interpreter (preloaded_workers) must not share one, or a restarted worker would
# pass for its dead predecessor retrying.
_RETRY_KEYS: dict[int, str] = {}


def retry_key() -> str:
    """This process's retry key."""
    return _RETRY_KEYS.setdefault(os.getpid(), secrets.token_hex(16))


# Between two Register attempts refused with ALREADY_EXISTS.
_ALREADY_EXISTS_BACKOFF_S = 0.5


def register(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    request: coordinator_pb2.RegisterRequest,
    *,
    timeout_s: float,
    token: str | None,
    stop: threading.Event,
) -> coordinator_pb2.RegisterResponse:
    """Register, retried on ALREADY_EXISTS until ``timeout_s`` passed; other errors raise."""
    request.retry_key = retry_key()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return stub.Register(
                request,
                timeout=max(left, 0.1),
                wait_for_ready=True,
                metadata=worker_metadata(token),
            )
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS or left <= 0 or stop.is_set():
                raise
        stop.wait(min(_ALREADY_EXISTS_BACKOFF_S, max(deadline - time.monotonic(), 0.0)))


def bounded_status(status: status_pb2.WorkerStatus | None) -> status_pb2.WorkerStatus | None:
    """The status, or None when it is over the coordinator's limit (64 KiB encoded).

    The coordinator refuses a heartbeat whose status is over the limit; sending the
    heartbeat without it keeps the lease (the listing keeps the last status).
    """
    if status is not None and status.ByteSize() > FIELD_LIMITS["status"]:
        log.warning(
            "worker status is %d bytes, over the coordinator's %d byte limit; heartbeat "
            "sent without it",
            status.ByteSize(),
            FIELD_LIMITS["status"],
        )
        return None
    return status
