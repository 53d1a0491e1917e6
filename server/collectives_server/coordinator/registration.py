"""Size limits on what a worker may store in the coordinator, checked before anything is stored.

Every field a worker sends with Register (and the status it sends with each
heartbeat) is copied into the Cluster message that GetCluster and WatchCluster
send to every client and worker, and gRPC refuses messages over 4 MiB. One worker
registering with a 3 MiB hostname used to make every Cluster message too large
for as long as it stayed listed. So:

* each field has a cap (:data:`~collectives_server.control_protocol.FIELD_LIMITS`,
  which workers read too), and a request over one is refused
  with INVALID_ARGUMENT naming the field and the limit (:func:`check_register`,
  :func:`check_status`);
* the whole message has a budget (:data:`CLUSTER_BUDGET_BYTES`, below gRPC's
  4 MiB): :class:`ClusterBudget` tracks the size of the last Cluster message built
  plus what was added since, and a registration or status that would take it over
  the budget is refused (RESOURCE_EXHAUSTED for a registration; for a heartbeat,
  the lease is renewed and the status dropped, so the worker is never declared
  lost over its status).
"""

from __future__ import annotations

from collections.abc import Iterable

from collectives.v1 import coordinator_pb2, status_pb2
from collectives_server.control_protocol import FIELD_LIMITS

__all__ = [
    "CLUSTER_BUDGET_BYTES",
    "ClusterBudget",
    "FieldTooLargeError",
    "check_register",
    "check_status",
    "worker_entry_bytes",
]

# gRPC's default maximum message is 4 MiB (4,194,304 bytes); the budget leaves room
# for the fields that are not per-worker and for framing.
CLUSTER_BUDGET_BYTES = 3_900_000


class FieldTooLargeError(ValueError):
    """A request field over its limit; the message names the field and the limit."""


def _check_bytes(name: str, value: str) -> None:
    size = len(value.encode("utf-8", "surrogatepass"))
    limit = FIELD_LIMITS[name]
    if size > limit:
        raise FieldTooLargeError(f"{name} is {size} bytes; the limit is {limit} bytes")


def check_register(request: coordinator_pb2.RegisterRequest) -> None:
    """Raises :class:`FieldTooLargeError` when a field of ``request`` is over its limit."""
    for name in ("hostname", "address", "version", "backend", "retry_key"):
        _check_bytes(name, getattr(request, name))
    if len(request.devices) > FIELD_LIMITS["devices"]:
        raise FieldTooLargeError(
            f"devices has {len(request.devices)} entries; the limit is {FIELD_LIMITS['devices']}"
        )
    for device in request.devices:
        _check_bytes("device", device)


def check_status(status: status_pb2.WorkerStatus) -> int:
    """The encoded size of a heartbeat's status; FieldTooLargeError over the limit."""
    size = status.ByteSize()
    if size > FIELD_LIMITS["status"]:
        raise FieldTooLargeError(
            f"status is {size} bytes encoded; the limit is {FIELD_LIMITS['status']} bytes"
        )
    return size


def worker_entry_bytes(request: coordinator_pb2.RegisterRequest) -> int:
    """What a registration adds to the Cluster message, before any status (an upper bound)."""
    info = coordinator_pb2.WorkerInfo(
        worker_id="w" * 32,
        rank=-1,
        address=request.address,
        hostname=request.hostname,
        pid=request.pid or -1,
        state=coordinator_pb2.WORKER_STATE_LOST,
        devices=request.devices,
        joined_generation=-1,
        last_heartbeat_age_s=1.5,
        backend=request.backend or "gloo",
        uptime_s=1.5,
        version=request.version,
    )
    # Tag and length prefix of the entry in Cluster.workers.
    return info.ByteSize() + 6


class ClusterBudget:
    """Tracks the Cluster message's size against :data:`CLUSTER_BUDGET_BYTES`. Not thread-safe.

    ``measured(n)`` records the size of a Cluster message just built; ``admit``
    asks whether ``extra`` more bytes still fit, counting what was admitted since
    the last measurement. Status sizes are kept per worker, so a status replacing
    an older one counts only the difference.
    """

    def __init__(self, budget_bytes: int = CLUSTER_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._measured = 0
        self._pending = 0
        self._status_bytes: dict[str, int] = {}

    @property
    def estimate(self) -> int:
        """Bytes of the Cluster message as of now (measured + admitted since)."""
        return self._measured + self._pending

    def measured(self, size: int) -> None:
        self._measured = size
        self._pending = 0

    def fits(self, extra: int) -> bool:
        return self.estimate + extra <= self.budget_bytes

    def admit(self, extra: int) -> None:
        self._pending += max(0, extra)

    def status_delta(self, worker_id: str, size: int) -> int:
        """How much a status of ``size`` bytes for ``worker_id`` grows the message."""
        return size - self._status_bytes.get(worker_id, 0)

    def set_status(self, worker_id: str, size: int) -> None:
        self.admit(self.status_delta(worker_id, size))
        self._status_bytes[worker_id] = size

    def forget_except(self, worker_ids: Iterable[str]) -> None:
        """Drops the status sizes of workers no longer listed."""
        keep = set(worker_ids)
        for worker_id in [w for w in self._status_bytes if w not in keep]:
            del self._status_bytes[worker_id]
