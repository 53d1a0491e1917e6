"""Who may call the coordinator's worker-only RPCs, and for which worker.

Clients and workers used to share one credential (``--token-file``), so anyone
holding it could register at a live worker's address (which declared that worker
lost), make any worker leave, or heartbeat for it with a forged status. Two
checks separate the roles:

* **The worker token.** With ``--worker-token-file`` on the coordinator, Register,
  Heartbeat, HeartbeatStream and Leave need the metadata
  ``collectives-worker-token: <token>`` (``WORKER_TOKEN_METADATA`` of
  :mod:`collectives_server.control_protocol`, which workers import), compared in
  constant time; without it they answer PERMISSION_DENIED, whatever bearer token the
  call carries. Clients never need it: GetCluster and WatchCluster stay open to the
  client token.
* **The lease secret.** Register returns a random ``lease_secret`` per
  registration, and Heartbeat, HeartbeatStream and Leave for that worker id must
  carry it: even a worker-token holder cannot heartbeat or leave for another
  worker. A Register at a live worker's address is answered ALREADY_EXISTS (the
  live worker keeps its place) unless it carries the ``retry_key`` of the
  registration that holds the address: that is a retry, and gets the same id and
  secret back.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from collectives.wire.security import check_token
from collectives_server.control_protocol import WORKER_TOKEN_METADATA

__all__ = [
    "LeaseBook",
    "WorkerAdmission",
]


class WorkerAdmission:
    """Checks the worker token of worker-only calls; ``token=None`` admits every caller."""

    def __init__(self, token: str | None = None) -> None:
        if token is not None:
            check_token(token)
        self._token = token.encode() if token is not None else None

    @property
    def required(self) -> bool:
        return self._token is not None

    def problem(self, metadata: Sequence[Any] | None) -> str | None:
        """Why a call with ``metadata`` is refused; None when it is admitted."""
        if self._token is None:
            return None
        values = [m.value for m in metadata or () if m.key == WORKER_TOKEN_METADATA]
        if not values:
            return (
                f"this RPC is for workers only: it needs the '{WORKER_TOKEN_METADATA}' metadata "
                "(the worker's --worker-token-file); a client token does not allow it"
            )
        value = values[-1]
        presented = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
        if not hmac.compare_digest(presented.strip(), self._token):
            return (
                f"invalid worker token: '{WORKER_TOKEN_METADATA}' does not match the "
                "coordinator's --worker-token-file"
            )
        return None


@dataclass
class _Lease:
    secret: str
    retry_key: str


class LeaseBook:
    """The lease secret and retry key of every registration. Not thread-safe."""

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def is_retry(self, worker_id: str, retry_key: str) -> bool:
        """Whether a Register with ``retry_key`` comes from the process that holds ``worker_id``."""
        lease = self._leases.get(worker_id)
        if lease is None or not lease.retry_key or not retry_key:
            return False
        return hmac.compare_digest(lease.retry_key.encode(), retry_key.encode())

    def issue(self, worker_id: str, retry_key: str) -> str:
        """The secret of ``worker_id``: the existing one for a retry, else a new one."""
        lease = self._leases.get(worker_id)
        if lease is not None and self.is_retry(worker_id, retry_key):
            return lease.secret
        lease = _Lease(secret=secrets.token_urlsafe(24), retry_key=retry_key)
        self._leases[worker_id] = lease
        return lease.secret

    def problem(self, worker_id: str, secret: str) -> str | None:
        """Why a Heartbeat/Leave for ``worker_id`` with ``secret`` is refused; None if allowed.

        An id without a lease here is left to the membership (NOT_FOUND: register again).
        """
        lease = self._leases.get(worker_id)
        if lease is None:
            return None
        if not secret:
            return f"no lease_secret for worker {worker_id!r}: send the one Register returned"
        if not hmac.compare_digest(lease.secret.encode(), secret.encode("utf-8", "replace")):
            return f"wrong lease_secret for worker {worker_id!r}"
        return None

    def forget(self, worker_id: str) -> None:
        self._leases.pop(worker_id, None)

    def keep_only(self, worker_ids: Iterable[str]) -> None:
        """Drops the leases of workers that are gone (left, or LOST)."""
        keep = set(worker_ids)
        for worker_id in [w for w in self._leases if w not in keep]:
            del self._leases[worker_id]

    def export(self) -> dict[str, list[str]]:
        """worker id -> [secret, retry key], for a successor coordinator (see membership_state)."""
        return {w: [lease.secret, lease.retry_key] for w, lease in self._leases.items()}

    def restore(self, data: dict[str, list[str]]) -> None:
        self._leases = {w: _Lease(secret=s, retry_key=k) for w, (s, k) in data.items()}
