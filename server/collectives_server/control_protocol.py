"""What the coordinator and its workers agree on beyond the protos.

The worker daemon is the coordinator's client on the control plane (Register,
Heartbeat, HeartbeatStream, Leave). Both sides need the metadata that carries
the worker token and the coordinator's per-field size limits: the coordinator
enforces them (``coordinator.admission``, ``coordinator.registration``), the
worker keeps within them (``worker.enrolment``, ``worker.daemon``). They live
here, in neither package, so that the worker imports nothing of the coordinator.
"""

from __future__ import annotations

__all__ = [
    "FIELD_LIMITS",
    "WORKER_TOKEN_METADATA",
    "worker_metadata",
]

# The metadata that carries the worker token on the worker-only RPCs.
WORKER_TOKEN_METADATA = "collectives-worker-token"

# What a worker may send with Register (and each heartbeat's status): field ->
# limit, in UTF-8 bytes (entries for "devices"). The coordinator refuses a
# request over one with INVALID_ARGUMENT naming the field.
FIELD_LIMITS: dict[str, int] = {
    "hostname": 255,  # a DNS name
    "address": 270,  # host:port, the host a DNS name or a bracketed IPv6 address
    "version": 64,
    "backend": 16,
    "devices": 64,  # entries
    "device": 64,  # bytes of one entry
    "status": 64 * 1024,  # a heartbeat's WorkerStatus, encoded
    "retry_key": 128,
}


def worker_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a worker adds to its worker-only calls (empty without a token)."""
    return ((WORKER_TOKEN_METADATA, token),) if token else ()
