"""Worker configuration: one frozen dataclass, units in the names."""

from __future__ import annotations

from dataclasses import dataclass, field

from collectives.wire.batching import Batching
from collectives.wire.security import PLAINTEXT, ChannelSecurity
from collectives_server.rpc.limits import RpcLimits
from collectives_server.security import ServerSecurity
from collectives_server.worker.data.limits import BulkLimits, ShmLimits
from collectives_server.worker.models.archive.checks import ModelUploadConfig


@dataclass(frozen=True)
class WorkerConfig:
    # host:port of the coordinator's gRPC server.
    coordinator: str
    # Interface and port this worker's gRPC server binds; port 0 picks a free one.
    host: str = "127.0.0.1"
    port: int = 0
    # "cpu" or CUDA devices ("cuda:0", "cuda:1"); empty: all visible CUDA devices, else cpu.
    devices: tuple[str, ...] = field(default_factory=tuple)
    # Collective timeout; None: use the coordinator's --op-timeout-s.
    op_timeout_s: float | None = None
    # Bound of the leader's op queue; a full queue answers RESOURCE_EXHAUSTED.
    queue_size: int = 1024
    # Ops the flight recorder keeps (flight_recorder.py); 0: recording is off.
    flight_recorder_ops: int = 2000
    # Bounds of the /dev/shm segments created for clients' gets (shm_segments.py).
    shm_limits: ShmLimits = field(default_factory=ShmLimits)
    # Bounds of the bulk port: ticket TTL, prelude and idle timeouts, connection caps.
    bulk_limits: BulkLimits = field(default_factory=BulkLimits)
    # Bounds of the gRPC data plane: calls at once, idle time, duration (rpc_limits.py).
    rpc_limits: RpcLimits = field(default_factory=RpcLimits)
    # Sub-groups (new_group) one generation may hold; beyond: RESOURCE_EXHAUSTED.
    max_groups: int = 64
    # Quota of the worker's tensor store in bytes; None: unbounded. Puts and
    # collective results beyond it answer RESOURCE_EXHAUSTED.
    max_tensor_bytes: int | None = None
    # How long a worker keeps trying to reach the coordinator at start-up.
    connect_timeout_s: float = 60.0
    # Prometheus endpoint: None serves none; 0 picks a free port (logged).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Name peers and clients use to reach this worker; None: --host (or the
    # machine's name when binding a wildcard address).
    advertise_host: str | None = None
    # Port peers and clients use (a NAT or container port mapping); None: the bound port.
    advertise_port: int | None = None
    # Python modules whose functions may build models (load_model(factory=...)).
    allow_factories: tuple[str, ...] = field(default_factory=tuple)
    # A forward's autograd graph is dropped if no backward comes within this time.
    graph_ttl_s: float = 60.0
    # The batching of models built by a factory whose load_model names none
    # (--factory-batching); None: they batch only if their load asks.
    factory_batching: Batching | None = None
    # TCP port of the bulk data plane (raw bytes of large put/get next to gRPC);
    # 0 picks a free one; None: no bulk port. Under TLS it speaks TLS (raw_tls).
    bulk_port: int | None = 0
    # Serve call lanes on the bulk port (small forwards framed over kept raw TCP
    # connections instead of a gRPC call each; worker/transport/lanes.py).
    call_lanes: bool = True
    # The methods the lanes carry (--lane-methods); None: every one they can.
    lane_methods: tuple[str, ...] | None = None
    # TLS / mutual TLS / bearer token of this worker's gRPC server.
    security: ServerSecurity = field(default_factory=ServerSecurity)
    # How this worker reaches the coordinator (TLS, client certificate, token).
    coordinator_security: ChannelSecurity = PLAINTEXT
    # Sent as 'collectives-worker-token' on Register/Heartbeat/Leave (--worker-token-file).
    worker_token: str | None = None
    # Model archive uploads: allowed?, bounds, upload dir, load sandbox (archive_upload.py).
    model_upload: ModelUploadConfig = field(default_factory=ModelUploadConfig)
