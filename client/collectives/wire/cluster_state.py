"""What the SDK knows about the cluster: workers and a snapshot of the membership.

The coordinator describes the cluster with one protobuf message
(``collectives.v1.Cluster``); the SDK turns it into immutable Python values once,
here, so the rest of the SDK (and dashboards built on it) never touch protobuf
enums or repeated fields. A :class:`ClusterSnapshot` is replaced wholesale when
the coordinator announces a new version, so readers never see half an update.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from collectives.errors import Unavailable
from collectives.v1 import coordinator_pb2, status_pb2
from collectives.wire.op_specs import check_rank

__all__ = [
    "DEFAULT_OP_TIMEOUT_S",
    "ClusterNotFormed",
    "ClusterSnapshot",
    "DeviceMemory",
    "GenerationRecord",
    "OpCount",
    "RecentError",
    "WorkerInfo",
    "WorkerState",
    "check_rank",
]

# The coordinator's --op-timeout-s default, used when it reports none.
DEFAULT_OP_TIMEOUT_S = 30.0


class ClusterNotFormed(Unavailable):
    """No sealed generation with enough live members (``UNAVAILABLE``); not retried."""


class WorkerState(enum.StrEnum):
    """Lifecycle of a worker as the coordinator sees it; a ``str`` equal to its value."""

    JOINING = "joining"
    READY = "ready"
    BUSY = "busy"
    DRAINING = "draining"
    LOST = "lost"

    @classmethod
    def from_wire(cls, value: int) -> WorkerState:
        # UNSPECIFIED (or a value from a newer server) reads as "joining": the
        # worker is registered but the SDK cannot claim it is a usable member.
        return _STATE_FROM_WIRE.get(value, cls.JOINING)


_STATE_FROM_WIRE: dict[int, WorkerState] = {
    coordinator_pb2.WORKER_STATE_JOINING: WorkerState.JOINING,
    coordinator_pb2.WORKER_STATE_READY: WorkerState.READY,
    coordinator_pb2.WORKER_STATE_BUSY: WorkerState.BUSY,
    coordinator_pb2.WORKER_STATE_DRAINING: WorkerState.DRAINING,
    coordinator_pb2.WORKER_STATE_LOST: WorkerState.LOST,
}


@dataclass(frozen=True)
class OpCount:
    """Ops of one kind a worker finished: ``completed`` succeeded, ``failed`` did not."""

    completed: int = 0
    failed: int = 0


@dataclass(frozen=True)
class DeviceMemory:
    """Memory of one device: CUDA as ``torch.cuda.mem_get_info`` sees the whole device;
    ``cpu`` as the worker process's resident set of the host's memory."""

    device: str
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class RecentError:
    """A failed op on a worker: ``op_id`` (0 for data-plane calls) as in the client's error."""

    unix_time_s: float
    op_id: int
    generation: int
    kind: str
    # gRPC status code name, e.g. "NOT_FOUND".
    code: str
    message: str


@dataclass(frozen=True)
class GenerationRecord:
    """One sealed generation: when, how big, who (addresses in rank order), and why."""

    generation: int
    sealed_unix_time_s: float
    world_size: int
    members: tuple[str, ...]
    reason: str
    # The coordinator that sealed it (with an HA set on etcd: the leader then).
    sealed_by: str = ""
    # The digest of its member ids in rank order (see ClusterSnapshot.membership_digest).
    membership_digest: str = ""

    @classmethod
    def from_proto(cls, msg: coordinator_pb2.GenerationRecord) -> GenerationRecord:
        return cls(
            generation=int(msg.generation),
            sealed_unix_time_s=float(msg.sealed_unix_time_s),
            world_size=int(msg.world_size),
            members=tuple(msg.members),
            reason=msg.reason,
            sealed_by=msg.sealed_by,
            membership_digest=msg.membership_digest,
        )


@dataclass(frozen=True)
class WorkerInfo:
    """One worker daemon as last reported by the coordinator.

    The fields after ``version`` come from the worker's status, which every
    heartbeat carries; ``has_status`` is False until the first one arrived (the
    fields then hold their zero values). Memory readings are refreshed on every
    change of the worker and at least every 10 s (see docs/design.md).
    """

    # Rank in the current generation; -1 when not a member (joining or lost).
    rank: int
    # host:port the worker's gRPC server listens on.
    address: str
    state: WorkerState
    # "cpu", "cuda:0", ...; never empty for a registered worker.
    devices: list[str]
    hostname: str
    pid: int
    worker_id: str
    # The generation whose process group this worker has joined (0: none yet).
    generation: int
    last_heartbeat_age_s: float
    # "gloo" or "nccl".
    backend: str
    uptime_s: float
    version: str
    has_status: bool = False
    tensors_held: int = 0
    bytes_held: int = 0
    models: tuple[str, ...] = ()
    # Model name -> version (1 after load_model, +1 per committed publish or step),
    # in name order; as many as fit the status's budget, the rest counted in
    # ``model_versions_omitted`` (``models`` still names every one).
    model_versions: Mapping[str, int] = field(default_factory=dict)
    model_versions_omitted: int = 0
    # kind ("all_reduce", "put", "forward", ...) -> counts
    ops: Mapping[str, OpCount] = field(default_factory=dict)
    last_op: str = ""
    last_op_latency_s: float = 0.0
    queue_depth: int = 0
    device_memory: tuple[DeviceMemory, ...] = ()
    package_version: str = ""
    torch_version: str = ""
    backend_version: str = ""
    # Data-plane payload bytes (puts received, gets sent).
    bytes_received: int = 0
    bytes_sent: int = 0
    process_rss_bytes: int = 0
    host_memory_total_bytes: int = 0
    host_memory_available_bytes: int = 0
    # The most recent failed ops, oldest first (at most 20).
    recent_errors: tuple[RecentError, ...] = ()
    data_collectives: int = 0
    gradient_buckets_reduced: int = 0
    graphs_retained: int = 0

    @property
    def is_member(self) -> bool:
        """True when the worker holds a rank in the current generation."""
        return self.rank >= 0

    @property
    def ops_completed(self) -> int:
        """Ops of every kind that succeeded."""
        return sum(c.completed for c in self.ops.values())

    @property
    def ops_failed(self) -> int:
        """Ops of every kind that failed."""
        return sum(c.failed for c in self.ops.values())

    @classmethod
    def from_proto(cls, msg: coordinator_pb2.WorkerInfo) -> WorkerInfo:
        return cls(
            **_status_fields(msg.status, msg.HasField("status")),
            rank=int(msg.rank),
            address=msg.address,
            state=WorkerState.from_wire(msg.state),
            devices=list(msg.devices),
            hostname=msg.hostname,
            pid=int(msg.pid),
            worker_id=msg.worker_id,
            generation=int(msg.joined_generation),
            last_heartbeat_age_s=float(msg.last_heartbeat_age_s),
            backend=msg.backend,
            uptime_s=float(msg.uptime_s),
            version=msg.version,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the state as its string value)."""
        return {
            "rank": self.rank,
            "address": self.address,
            "state": self.state.value,
            "devices": list(self.devices),
            "hostname": self.hostname,
            "pid": self.pid,
            "worker_id": self.worker_id,
            "generation": self.generation,
            "last_heartbeat_age_s": self.last_heartbeat_age_s,
            "backend": self.backend,
            "uptime_s": self.uptime_s,
            "version": self.version,
            **self._status_dict(),
        }

    def _status_dict(self) -> dict[str, Any]:
        return {
            "has_status": self.has_status,
            "tensors_held": self.tensors_held,
            "bytes_held": self.bytes_held,
            "models": list(self.models),
            "model_versions": dict(self.model_versions),
            "model_versions_omitted": self.model_versions_omitted,
            "ops": {kind: asdict(count) for kind, count in self.ops.items()},
            "ops_completed": self.ops_completed,
            "ops_failed": self.ops_failed,
            "last_op": self.last_op,
            "last_op_latency_s": self.last_op_latency_s,
            "queue_depth": self.queue_depth,
            "device_memory": [asdict(d) for d in self.device_memory],
            "package_version": self.package_version,
            "torch_version": self.torch_version,
            "backend_version": self.backend_version,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "process_rss_bytes": self.process_rss_bytes,
            "host_memory_total_bytes": self.host_memory_total_bytes,
            "host_memory_available_bytes": self.host_memory_available_bytes,
            "recent_errors": [asdict(e) for e in self.recent_errors],
            "data_collectives": self.data_collectives,
            "gradient_buckets_reduced": self.gradient_buckets_reduced,
            "graphs_retained": self.graphs_retained,
        }


def _status_fields(s: status_pb2.WorkerStatus, present: bool) -> dict[str, Any]:
    """WorkerInfo's status fields from a ``WorkerStatus`` message."""
    return {
        "has_status": present,
        "tensors_held": int(s.tensors_held),
        "bytes_held": int(s.bytes_held),
        "models": tuple(s.models),
        "model_versions": {m.name: int(m.version) for m in s.model_versions},
        "model_versions_omitted": int(s.model_versions_omitted),
        "ops": {o.kind: OpCount(int(o.completed), int(o.failed)) for o in s.ops},
        "last_op": s.last_op,
        "last_op_latency_s": float(s.last_op_latency_s),
        "queue_depth": int(s.queue_depth),
        "device_memory": tuple(
            DeviceMemory(d.device, int(d.memory_used_bytes), int(d.memory_total_bytes))
            for d in s.devices
        ),
        "package_version": s.package_version,
        "torch_version": s.torch_version,
        "backend_version": s.backend_version,
        "bytes_received": int(s.bytes_received),
        "bytes_sent": int(s.bytes_sent),
        "process_rss_bytes": int(s.process_rss_bytes),
        "host_memory_total_bytes": int(s.host_memory_total_bytes),
        "host_memory_available_bytes": int(s.host_memory_available_bytes),
        "recent_errors": tuple(
            RecentError(
                float(e.unix_time_s), int(e.op_id), int(e.generation), e.kind, e.code, e.message
            )
            for e in s.recent_errors
        ),
        "data_collectives": int(s.data_collectives),
        "gradient_buckets_reduced": int(s.gradient_buckets_reduced),
        "graphs_retained": int(s.graphs_retained),
    }


@dataclass(frozen=True)
class ClusterSnapshot:
    """One version of the coordinator's ``Cluster`` message, as plain values."""

    generation: int
    formed: bool
    ready: bool
    world_size: int
    # Members in rank order, then non-members (rank -1), as the coordinator sends them.
    workers: tuple[WorkerInfo, ...]
    version: int
    status: str
    op_timeout_s: float
    min_workers: int = 0
    max_workers: int = 0
    store_address: str = ""
    # The most recent sealed generations, oldest first (the coordinator keeps 50).
    history: tuple[GenerationRecord, ...] = ()
    # The coordinator that decides membership ("" while an HA set has no leader),
    # and where membership lives ("memory" or "etcd").
    coordinator_leader: str = ""
    store: str = "memory"
    # Which membership the generation is: the digest of the members' ids in rank
    # order (collectives.wire.membership); sent with every op, so a worker whose
    # group is another membership refuses it. "" while not formed.
    membership_digest: str = ""
    # Members indexed by rank, derived from ``workers``.
    _by_rank: dict[int, WorkerInfo] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_rank.update({w.rank: w for w in self.workers if w.rank >= 0})

    @classmethod
    def from_proto(cls, msg: coordinator_pb2.Cluster) -> ClusterSnapshot:
        return cls(
            generation=int(msg.generation),
            formed=bool(msg.formed),
            ready=bool(msg.ready),
            world_size=int(msg.world_size),
            workers=tuple(WorkerInfo.from_proto(w) for w in msg.workers),
            version=int(msg.version),
            status=msg.status,
            op_timeout_s=float(msg.op_timeout_s) or DEFAULT_OP_TIMEOUT_S,
            min_workers=int(msg.min_workers),
            max_workers=int(msg.max_workers),
            store_address=msg.store_address,
            history=tuple(GenerationRecord.from_proto(r) for r in msg.history),
            coordinator_leader=msg.leader,
            store=msg.store or "memory",
            membership_digest=msg.membership_digest,
        )

    def digest_of(self, generation: int) -> str:
        """The membership digest of ``generation`` if it is this snapshot's, else ""
        (a group's older or newer generation: its generation check decides)."""
        return self.membership_digest if generation == self.generation else ""

    @property
    def members(self) -> list[WorkerInfo]:
        """Workers holding a rank in the current generation, in rank order."""
        return [self._by_rank[r] for r in sorted(self._by_rank)]

    @property
    def leader_address(self) -> str | None:
        """Address of rank 0, which sequences every collective; None when not formed."""
        leader = self._by_rank.get(0)
        return leader.address if self.formed and leader is not None else None

    def address_of(self, rank: int) -> str:
        """The address serving ``rank``.

        Raises:
            Unavailable: the cluster is not formed or no member holds ``rank``.
            InvalidArgument: ``rank`` is outside ``[0, world_size)``.
        """
        self.require_formed()
        check_rank(rank, self.world_size)
        worker = self._by_rank.get(rank)
        if worker is None:
            raise Unavailable(
                f"no worker holds rank {rank} in generation {self.generation} "
                f"(coordinator status: {self.status or 'none'})"
            )
        return worker.address

    def require_formed(self) -> None:
        """Raises :class:`ClusterNotFormed` quoting the coordinator's status when not formed."""
        if not self.formed or self.world_size <= 0:
            raise ClusterNotFormed(
                f"the cluster is not formed (generation {self.generation}, "
                f"{self.world_size} members): {self.status or 'no status'}"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, as ``collectives status --json`` prints it."""
        return {
            "generation": self.generation,
            "formed": self.formed,
            "ready": self.ready,
            "world_size": self.world_size,
            "version": self.version,
            "status": self.status,
            "op_timeout_s": self.op_timeout_s,
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "store_address": self.store_address,
            "workers": [w.to_dict() for w in self.workers],
            "history": [asdict(r) for r in self.history],
            "coordinator_leader": self.coordinator_leader,
            "store": self.store,
        }
