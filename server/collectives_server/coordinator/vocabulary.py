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
    "DrainRefusedError",
    "DrainReport",
    "Handoff",
    "HandoffOutcome",
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


class DrainRefusedError(ValueError):
    """A drain that cannot start; ``code`` is ``"not_found"`` (no such worker) or
    ``"failed_precondition"`` (not a member, not formed, a drain in progress, no spare)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


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
    # Every rank holds what the same rank held in the generation before (a drain's
    # completed handoff, or one called off before any op ran in it).
    carried_over: bool = False
    # The drain (Handoff.drain_id) whose groups formed ahead its members take; "".
    formed_ahead: str = ""


@dataclass(frozen=True)
class Handoff:
    """A drain in progress: ``rank`` passes from ``drained`` to ``successor`` ("" when
    the cluster shrinks), who must report before anyone joins ``generation_after``."""

    drained: str  # worker id
    successor: str  # worker id; "" for a shrink
    rank: int
    generation_before: int
    generation_after: int
    started_at: float  # the membership's clock
    deadline: float  # called off when not done by then
    total_tensors: int = 0  # as the drained worker's last status reported
    total_bytes: int = 0
    bytes_copied: int = 0  # so far, as the successor's heartbeats say
    # Not sealed yet (``generation_after`` is the one it will seal): the members it
    # will have, in rank order, and those ready to switch to it (groups formed
    # ahead, the successor's copy taken), sealed when all are or at ``prepare_by``.
    preparing: bool = False
    planned: tuple[str, ...] = ()
    prepared: tuple[str, ...] = ()
    prepare_by: float = 0.0  # the membership's clock
    formed_ahead: bool = False  # sealed with every planned member ready
    sealed_at: float | None = None  # the membership's clock; None while preparing
    drain_id: str = ""  # this drain's own name (another for a drain asked again)

    @property
    def shrink(self) -> bool:
        return not self.successor

    @property
    def reporter(self) -> str:
        """Who reports the handoff's end: the successor, or the drained worker in a shrink."""
        return self.successor or self.drained


@dataclass(frozen=True)
class HandoffOutcome:
    """What the worker doing a handoff reported (``HandoffResult``)."""

    generation_after: int
    ok: bool
    error: str = ""
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    lost: tuple[str, ...] = ()
    models: int = 0


@dataclass(frozen=True)
class DrainReport:
    """How one drain ended (``error`` "" when it completed)."""

    worker: str  # address
    worker_id: str
    rank: int
    successor: str  # address; "" when the cluster shrank
    successor_id: str
    generation_before: int
    generation_after: int
    seconds: float
    finished_at: float  # the membership's clock
    bytes_moved: int = 0
    tensors_moved: int = 0
    models_moved: int = 0
    lost: tuple[str, ...] = ()
    shrink: bool = False
    error: str = ""
    copy_seconds: float = 0.0  # of ``seconds``: the successor's copy alone
    prepare_seconds: float = 0.0  # of ``seconds``: before the seal
    drain_id: str = ""  # the drain's own name (Handoff.drain_id)


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
    # The drain in progress (with the drained and successor addresses), if any.
    handoff: Handoff | None = None
    handoff_addresses: tuple[str, str] = ("", "")
    # The last drains, oldest first (bounded), and totals since the start.
    drains: tuple[DrainReport, ...] = ()
    drains_completed: int = 0
    drain_bytes_total: int = 0
