"""The coordinator's vocabulary: worker rows, snapshots, sealed generations,
outcomes and errors.

Kept apart from :mod:`.membership` (the rules) so the servicer and tests can
import the vocabulary without the state machine; none of it knows protobuf.
A worker's state is the protocol's own :class:`~collectives.wire.cluster_state.WorkerState`
(the values the Cluster message carries), re-exported here; what the SDK calls
a ``GenerationRecord`` (``collectives.wire.cluster_state``) is, on this side, a
:class:`SealedGeneration`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collectives.wire.cluster_state import WorkerState

__all__ = [
    "ClusterView",
    "InvalidRequestError",
    "Outcome",
    "SealedGeneration",
    "UnknownWorkerError",
    "WorkerState",
    "WorkerView",
]


class UnknownWorkerError(KeyError):
    """The worker id is unknown or was declared LOST: the worker must register again."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown worker"


class InvalidRequestError(ValueError):
    """A malformed request (no address, no devices, impossible generation)."""


@dataclass(frozen=True)
class Outcome:
    """What an event did: ``changed`` is True when ``version`` increased."""

    changed: bool
    reason: str
    # A new generation was sealed.
    sealed: bool = False
    # Worker ids declared LOST by this event.
    lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerView:
    """One row of the Cluster message, with ages computed at ``now``."""

    worker_id: str
    rank: int
    address: str
    hostname: str
    pid: int
    state: WorkerState
    devices: tuple[str, ...]
    joined_generation: int
    last_heartbeat_age_s: float
    backend: str
    uptime_s: float
    version: str
    # The worker's last reported status (a collectives.v1.WorkerStatus; opaque
    # here), None until its first heartbeat carrying one.
    status: Any = None
    store_port: int = 0


@dataclass(frozen=True)
class SealedGeneration:
    """One sealed generation, for the history dashboards show."""

    generation: int
    # When it was sealed, on the membership's (monotonic) clock.
    sealed_at: float
    world_size: int
    # Worker addresses in rank order.
    members: tuple[str, ...]
    # The event and decision that sealed it ("w-3 at h:1 lost: ...; sealed generation 4 ...").
    reason: str
    # The coordinator that sealed it (its address; "" for an unnamed one).
    sealed_by: str = ""
    # The digest of its member ids in rank order (collectives_server.membership_digest).
    membership_digest: str = ""


@dataclass(frozen=True)
class ClusterView:
    """A snapshot of the membership, in the shape of the Cluster message."""

    generation: int
    formed: bool
    world_size: int
    workers: tuple[WorkerView, ...]
    version: int
    min_workers: int
    max_workers: int
    status: str
    ready: bool
    # The most recent sealed generations, oldest first (bounded).
    history: tuple[SealedGeneration, ...] = ()
    # The digest of the members' ids in rank order; "" while not formed.
    membership_digest: str = ""
