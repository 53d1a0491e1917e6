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
from collectives.v1 import coordinator_pb2, flight_record_pb2, status_pb2
from collectives.wire.op_phases import phases_of
from collectives.wire.op_specs import check_rank, spec_named

__all__ = [
    "DEFAULT_OP_TIMEOUT_S",
    "ClusterNotFormed",
    "ClientInfo",
    "ClusterClient",
    "ClusterErrorGroup",
    "ClusterSnapshot",
    "DeviceMemory",
    "DrainInProgress",
    "DrainReport",
    "ErrorGroup",
    "RecentOp",
    "GenerationRecord",
    "OpCount",
    "RecentError",
    "WorkerInfo",
    "WorkerState",
    "check_rank",
    "is_sequenced_kind",
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
    # Live, not a member: the generation is full; the next one takes it in when a
    # member is lost or leaves.
    SPARE = "spare"

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
    coordinator_pb2.WORKER_STATE_SPARE: WorkerState.SPARE,
}


def _single(value: float) -> float:
    """A single-precision proto field as the decimal it was written from (7 digits):
    0.001, not 0.0010000000474974513."""
    return float(f"{value:.7g}")


@dataclass(frozen=True)
class OpCount:
    """Ops of one kind a worker finished: ``completed`` succeeded, ``failed`` did not.

    ``rate_per_s`` counts both over about the last 10 s; the latency percentiles
    are over the kind's last 512 ops. The collective bytes are the payload this
    rank moved for the kind's collectives, from the operand size and the
    bandwidth-optimal algorithm's traffic (an all_reduce of ``n`` bytes at world
    size ``p``: ``2(p-1)/p·n`` each way; see ``docs/api.md``).
    """

    completed: int = 0
    failed: int = 0
    rate_per_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    collective_bytes_received: int = 0
    collective_bytes_sent: int = 0

    @classmethod
    def from_proto(cls, o: status_pb2.OpCount) -> OpCount:
        return cls(
            int(o.completed),
            int(o.failed),
            _single(o.rate_per_s),
            o.latency_p50_us / 1e6,
            o.latency_p99_us / 1e6,
            int(o.collective_bytes_received),
            int(o.collective_bytes_sent),
        )


@dataclass(frozen=True)
class ErrorGroup:
    """Failed ops of one kind with one code and message, counted as one row."""

    kind: str
    code: str
    message: str
    count: int
    first_unix_time_s: float
    last_unix_time_s: float
    # Failures per second over about the last 10 s.
    rate_per_s: float
    # The client that issued the latest one, as ClientInfo.label ("" when this
    # worker did not receive the call: only the leader receives a collective).
    client: str = ""
    last_op_id: int = 0

    @classmethod
    def from_proto(cls, g: status_pb2.ErrorGroup) -> ErrorGroup:
        return cls(
            g.kind,
            g.code,
            g.message,
            int(g.count),
            float(g.first_unix_time_s),
            float(g.last_unix_time_s),
            _single(g.rate_per_s),
            g.client,
            int(g.last_op_id),
        )


@dataclass(frozen=True)
class ClientInfo:
    """A client that called a worker in the last 60 s."""

    # gRPC peer, "ipv4:127.0.0.1:53412".
    peer: str
    # Its gRPC user agent without the name token and gRPC's C-core suffix
    # ("grpc-python/1.85.1"; at most 64 characters).
    user_agent: str
    # What the client set in COLLECTIVES_CLIENT_NAME ("" when nothing).
    name: str
    last_unix_time_s: float

    @property
    def label(self) -> str:
        """``name (peer)``, or the peer alone: how an :class:`ErrorGroup` names it."""
        return f"{self.name} ({self.peer})" if self.name else self.peer

    @classmethod
    def from_proto(cls, c: status_pb2.ClientStatus) -> ClientInfo:
        return cls(c.peer, c.user_agent, c.name, float(c.last_unix_time_s))


@dataclass(frozen=True)
class RecentOp:
    """One of a worker's last ops, from its flight recorder (the dashboard's timeline)."""

    op_id: int
    generation: int
    rank: int  # the worker's rank in the op's generation
    kind: str
    names: tuple[str, ...]
    # phase (collectives.wire.op_phases.PHASES) -> Unix seconds, if reached
    phases: Mapping[str, float]
    # the gRPC status code value: 0 committed, -1 still in flight
    code: int

    @classmethod
    def from_proto(cls, op: flight_record_pb2.FlightRecordOp) -> RecentOp:
        return cls(
            int(op.op_id), int(op.generation), int(op.rank), op.kind, tuple(op.names),
            phases_of(op), int(op.code),
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "names": list(self.names), "phases": dict(self.phases)}


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
    # Sealed by a drain whose handoff completed (or was called off before any op ran
    # in it): every rank holds what the same rank held in the generation before.
    carried_over: bool = False

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
            carried_over=bool(msg.carried_over),
        )


@dataclass(frozen=True)
class DrainReport:
    """How one drain ended (``cluster.drain`` returns it; ``snapshot().drains`` keeps
    the last ones). ``error`` is "" when it completed."""

    worker: str  # the drained worker's address
    worker_id: str
    rank: int
    successor: str  # its successor's address; "" when the cluster shrank
    successor_id: str
    bytes_moved: int
    tensors_moved: int
    models_moved: int  # models the drained worker hosted; the successor got them from peers
    seconds: float
    generation_before: int
    generation_after: int
    lost: tuple[str, ...] = ()  # tensor names lost with the rank (shrink only)
    shrink: bool = False
    error: str = ""
    finished_unix_time_s: float = 0.0
    copy_seconds: float = 0.0  # of ``seconds``: the successor's copy alone
    # Of ``seconds``: the preparation before the seal (the rank served meanwhile); the
    # rest is the switch, which calls for the rank wait out.
    prepare_seconds: float = 0.0

    @classmethod
    def from_proto(cls, msg: coordinator_pb2.DrainReport) -> DrainReport:
        return cls(
            worker=msg.worker,
            worker_id=msg.worker_id,
            rank=int(msg.rank),
            successor=msg.successor,
            successor_id=msg.successor_id,
            bytes_moved=int(msg.bytes_moved),
            tensors_moved=int(msg.tensors_moved),
            models_moved=int(msg.models_moved),
            seconds=float(msg.seconds),
            generation_before=int(msg.generation_before),
            generation_after=int(msg.generation_after),
            lost=tuple(msg.lost),
            shrink=bool(msg.shrink),
            error=msg.error,
            finished_unix_time_s=float(msg.finished_unix_time_s),
            copy_seconds=float(msg.copy_seconds),
            prepare_seconds=float(msg.prepare_seconds),
        )


@dataclass(frozen=True)
class DrainInProgress:
    """A drain whose handoff has not ended: ``rank`` passes from ``worker`` to
    ``successor`` ("" when the cluster shrinks) in ``generation_after``. While it is
    ``preparing``, ``generation_after`` is not sealed yet and the current generation
    serves as before (its members form the next one's groups ahead, the successor
    copies ahead)."""

    worker: str
    worker_id: str
    successor: str
    successor_id: str
    rank: int
    generation_before: int
    generation_after: int
    started_unix_time_s: float
    total_tensors: int
    total_bytes: int
    bytes_copied: int = 0  # so far
    preparing: bool = False

    @classmethod
    def from_proto(cls, msg: coordinator_pb2.Handoff) -> DrainInProgress:
        return cls(
            worker=msg.drained_address,
            worker_id=msg.drained_id,
            successor=msg.successor_address,
            successor_id=msg.successor_id,
            rank=int(msg.rank),
            generation_before=int(msg.generation_before),
            generation_after=int(msg.generation_after),
            started_unix_time_s=float(msg.started_unix_time_s),
            total_tensors=int(msg.total_tensors),
            total_bytes=int(msg.total_bytes),
            bytes_copied=int(msg.bytes_copied),
            preparing=bool(msg.preparing),
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
    # Models loaded with batching: model -> (merged forwards its batcher ran, their rows).
    model_batches: Mapping[str, tuple[int, int]] = field(default_factory=dict)
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
    # Collective payload bytes of every kind (the sums of ``ops``' collective bytes).
    collective_bytes_received: int = 0
    collective_bytes_sent: int = 0
    # Failed ops grouped by kind, code and message, most recent first (at most 16).
    error_groups: tuple[ErrorGroup, ...] = ()
    # Clients that called this worker in the last 60 s, most recent first (at most 16).
    clients: tuple[ClientInfo, ...] = ()
    # The worker's last ops (at most 24, oldest first) with their phase times.
    recent_ops: tuple[RecentOp, ...] = ()
    # Its op in flight longer than a quarter of the op timeout, in words ("": none).
    stuck: str = ""

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
            "model_batches": {name: list(done) for name, done in self.model_batches.items()},
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
            "collective_bytes_received": self.collective_bytes_received,
            "collective_bytes_sent": self.collective_bytes_sent,
            "error_groups": [asdict(g) for g in self.error_groups],
            "clients": [{**asdict(c), "label": c.label} for c in self.clients],
            "recent_ops": [op.to_dict() for op in self.recent_ops],
            "stuck": self.stuck,
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
        "model_batches": {
            m.name: (int(m.batches), int(m.batched_rows)) for m in s.model_versions if m.batches
        },
        "ops": {o.kind: OpCount.from_proto(o) for o in s.ops},
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
        "collective_bytes_received": sum(int(o.collective_bytes_received) for o in s.ops),
        "collective_bytes_sent": sum(int(o.collective_bytes_sent) for o in s.ops),
        "error_groups": tuple(ErrorGroup.from_proto(g) for g in s.error_groups),
        "clients": tuple(ClientInfo.from_proto(c) for c in s.clients),
        "recent_ops": tuple(RecentOp.from_proto(op) for op in s.recent_ops),
        "stuck": s.stuck,
    }


def is_sequenced_kind(kind: str) -> bool:
    """Whether ``kind`` is a sequenced op (a collective, a group or model op the
    leader numbers), which every member of its group runs and counts, rather than
    a call one worker serves (``put``, ``get``, ``forward``, ...)."""
    try:
        return spec_named(kind).sequenced
    except ValueError:
        return False


def _cluster_op_count(kind: str, counts: list[OpCount]) -> OpCount:
    """One kind over the workers: a sequenced op runs on every member, and each
    counts it, so its counts and rate are the largest worker's; calls one worker
    serves add up. p50/p99 are the slowest worker's; the bytes add up."""
    pick = max if is_sequenced_kind(kind) else sum
    return OpCount(
        completed=pick(c.completed for c in counts),
        failed=pick(c.failed for c in counts),
        rate_per_s=pick(c.rate_per_s for c in counts),
        latency_p50_s=max(c.latency_p50_s for c in counts),
        latency_p99_s=max(c.latency_p99_s for c in counts),
        collective_bytes_received=sum(c.collective_bytes_received for c in counts),
        collective_bytes_sent=sum(c.collective_bytes_sent for c in counts),
    )


@dataclass(frozen=True)
class ClusterClient:
    """A client over the workers it called: one channel (peer) per worker."""

    name: str
    # The peers' host, "ipv4:127.0.0.1".
    host: str
    user_agent: str
    peers: tuple[str, ...]
    workers: tuple[str, ...]
    last_unix_time_s: float


@dataclass(frozen=True)
class ClusterErrorGroup:
    """An :class:`ErrorGroup` over the workers that reported it (a collective that
    fails is reported by every rank that ran it: its count is the largest rank's)."""

    group: ErrorGroup
    # The addresses of the workers that reported it, and their ranks (-1: none).
    reporters: tuple[str, ...]
    ranks: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.group), "reporters": list(self.reporters), "ranks": list(self.ranks)}


def _merge_error_groups(workers: tuple[WorkerInfo, ...]) -> list[ClusterErrorGroup]:
    found: dict[tuple[str, str, str], list[tuple[WorkerInfo, ErrorGroup]]] = {}
    for w in workers:
        for g in w.error_groups:
            found.setdefault((g.kind, g.code, g.message), []).append((w, g))
    merged = []
    for (kind, code, message), reports in found.items():
        groups = [g for _, g in reports]
        pick = max if is_sequenced_kind(kind) else sum
        latest = max(groups, key=lambda g: g.last_unix_time_s)
        client = next((g.client for g in groups if g.client), "")
        group = ErrorGroup(
            kind=kind,
            code=code,
            message=message,
            count=pick(g.count for g in groups),
            first_unix_time_s=min(g.first_unix_time_s for g in groups),
            last_unix_time_s=latest.last_unix_time_s,
            rate_per_s=pick(g.rate_per_s for g in groups),
            client=client,
            last_op_id=latest.last_op_id,
        )
        ranks = tuple(sorted(w.rank for w, _ in reports))
        merged.append(ClusterErrorGroup(group, tuple(w.address for w, _ in reports), ranks))
    merged.sort(key=lambda m: m.group.last_unix_time_s, reverse=True)
    return merged


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
    # order (collectives_server.membership_digest); sent with every op, so a worker whose
    # group is another membership refuses it. "" while not formed.
    membership_digest: str = ""
    # The drain in progress, if any; the last drains (oldest first) and totals.
    drain: DrainInProgress | None = None
    drains: tuple[DrainReport, ...] = ()
    drains_completed: int = 0
    drain_bytes_total: int = 0
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
            drain=DrainInProgress.from_proto(msg.handoff) if msg.HasField("handoff") else None,
            drains=tuple(DrainReport.from_proto(r) for r in msg.drains),
            drains_completed=int(msg.drains_completed),
            drain_bytes_total=int(msg.drain_bytes_total),
        )

    def carried_over_since(self, generation: int) -> bool | None:
        """Whether every rank of this generation holds what the same rank held in
        ``generation`` (only drains' completed handoffs came between): True, False,
        or None while a drain's handoff may still decide it."""
        drain = self.drain
        if drain is not None and not drain.preparing and drain.generation_after > generation:
            return None
        sealed = {r.generation: r for r in self.history}
        between = range(generation + 1, self.generation + 1)
        return all(g in sealed and sealed[g].carried_over for g in between)

    def digest_of(self, generation: int) -> str:
        """The membership digest of ``generation`` if it is this snapshot's, else ""
        (a group's older or newer generation: its generation check decides)."""
        return self.membership_digest if generation == self.generation else ""

    def ops_by_kind(self) -> dict[str, OpCount]:
        """kind -> the cluster's counts, rate, p50/p99 and collective bytes, over the
        live workers (see ``_cluster_op_count`` for how workers combine)."""
        found: dict[str, list[OpCount]] = {}
        for w in self.workers:
            if w.state is WorkerState.LOST:
                continue
            for kind, count in w.ops.items():
                found.setdefault(kind, []).append(count)
        return {kind: _cluster_op_count(kind, counts) for kind, counts in sorted(found.items())}

    def error_groups(self) -> list[ClusterErrorGroup]:
        """The workers' error groups merged by kind, code and message, most recent first."""
        return _merge_error_groups(self.workers)

    def clients(self) -> list[ClusterClient]:
        """The clients the workers saw in the last 60 s, one entry per client (its
        name, or its host, with its user agent), most recently seen first."""
        found: dict[tuple[str, str, str], list[tuple[WorkerInfo, ClientInfo]]] = {}
        for w in self.workers:
            for c in w.clients:
                host = c.peer.rsplit(":", 1)[0]
                found.setdefault((c.name, "" if c.name else host, c.user_agent), []).append((w, c))
        out = [
            ClusterClient(
                name=name,
                host=host or reports[0][1].peer.rsplit(":", 1)[0],
                user_agent=agent,
                peers=tuple(sorted({c.peer for _, c in reports})),
                workers=tuple(sorted({w.address for w, _ in reports})),
                last_unix_time_s=max(c.last_unix_time_s for _, c in reports),
            )
            for (name, host, agent), reports in found.items()
        ]
        return sorted(out, key=lambda c: -c.last_unix_time_s)

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

    def older_than(self, other: ClusterSnapshot) -> bool:
        """Whether this view precedes ``other``: an earlier generation, or an earlier
        version of the same generation (a later generation is newer whatever its
        version). A client's view never moves to an older one, whichever coordinator
        of a set answered it."""
        if self.generation != other.generation:
            return self.generation < other.generation
        return self.version < other.version

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
            "drain": asdict(self.drain) if self.drain is not None else None,
            "drains": [asdict(r) for r in self.drains],
            "drains_completed": self.drains_completed,
            "drain_bytes_total": self.drain_bytes_total,
            "coordinator_leader": self.coordinator_leader,
            "store": self.store,
            "ops_by_kind": {kind: asdict(c) for kind, c in self.ops_by_kind().items()},
            "error_groups": [g.to_dict() for g in self.error_groups()],
            "clients": [asdict(c) for c in self.clients()],
        }
