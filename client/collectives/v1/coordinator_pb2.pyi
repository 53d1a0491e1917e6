from collectives.v1 import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_JOINING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_BUSY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_LOST: _ClassVar[WorkerState]
    WORKER_STATE_SPARE: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_JOINING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_BUSY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_LOST: WorkerState
WORKER_STATE_SPARE: WorkerState

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "rank", "address", "hostname", "pid", "state", "devices", "joined_generation", "last_heartbeat_age_s", "backend", "uptime_s", "version", "status")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    JOINED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rank: int
    address: str
    hostname: str
    pid: int
    state: WorkerState
    devices: _containers.RepeatedScalarFieldContainer[str]
    joined_generation: int
    last_heartbeat_age_s: float
    backend: str
    uptime_s: float
    version: str
    status: _status_pb2.WorkerStatus
    def __init__(self, worker_id: _Optional[str] = ..., rank: _Optional[int] = ..., address: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., devices: _Optional[_Iterable[str]] = ..., joined_generation: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., backend: _Optional[str] = ..., uptime_s: _Optional[float] = ..., version: _Optional[str] = ..., status: _Optional[_Union[_status_pb2.WorkerStatus, _Mapping]] = ...) -> None: ...

class GenerationRecord(_message.Message):
    __slots__ = ("generation", "sealed_unix_time_s", "world_size", "members", "reason", "sealed_by", "membership_digest", "carried_over", "formed_ahead")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEALED_UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SEALED_BY_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CARRIED_OVER_FIELD_NUMBER: _ClassVar[int]
    FORMED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    generation: int
    sealed_unix_time_s: float
    world_size: int
    members: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    sealed_by: str
    membership_digest: str
    carried_over: bool
    formed_ahead: str
    def __init__(self, generation: _Optional[int] = ..., sealed_unix_time_s: _Optional[float] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., sealed_by: _Optional[str] = ..., membership_digest: _Optional[str] = ..., carried_over: _Optional[bool] = ..., formed_ahead: _Optional[str] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("drained_id", "drained_address", "successor_id", "successor_address", "rank", "generation_before", "generation_after", "started_unix_time_s", "total_tensors", "total_bytes", "bytes_copied", "preparing", "formed_ahead", "store_address", "drain_id")
    DRAINED_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SUCCESSOR_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESSOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_BEFORE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_AFTER_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    PREPARING_FIELD_NUMBER: _ClassVar[int]
    FORMED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_ID_FIELD_NUMBER: _ClassVar[int]
    drained_id: str
    drained_address: str
    successor_id: str
    successor_address: str
    rank: int
    generation_before: int
    generation_after: int
    started_unix_time_s: float
    total_tensors: int
    total_bytes: int
    bytes_copied: int
    preparing: bool
    formed_ahead: bool
    store_address: str
    drain_id: str
    def __init__(self, drained_id: _Optional[str] = ..., drained_address: _Optional[str] = ..., successor_id: _Optional[str] = ..., successor_address: _Optional[str] = ..., rank: _Optional[int] = ..., generation_before: _Optional[int] = ..., generation_after: _Optional[int] = ..., started_unix_time_s: _Optional[float] = ..., total_tensors: _Optional[int] = ..., total_bytes: _Optional[int] = ..., bytes_copied: _Optional[int] = ..., preparing: _Optional[bool] = ..., formed_ahead: _Optional[bool] = ..., store_address: _Optional[str] = ..., drain_id: _Optional[str] = ...) -> None: ...

class HandoffResult(_message.Message):
    __slots__ = ("generation_after", "ok", "error", "tensors", "bytes", "seconds", "lost", "models")
    GENERATION_AFTER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    generation_after: int
    ok: bool
    error: str
    tensors: int
    bytes: int
    seconds: float
    lost: _containers.RepeatedScalarFieldContainer[str]
    models: int
    def __init__(self, generation_after: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., lost: _Optional[_Iterable[str]] = ..., models: _Optional[int] = ...) -> None: ...

class DrainReport(_message.Message):
    __slots__ = ("worker", "worker_id", "rank", "successor", "successor_id", "bytes_moved", "tensors_moved", "models_moved", "seconds", "generation_before", "generation_after", "lost", "shrink", "error", "finished_unix_time_s", "copy_seconds", "prepare_seconds")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SUCCESSOR_FIELD_NUMBER: _ClassVar[int]
    SUCCESSOR_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_MOVED_FIELD_NUMBER: _ClassVar[int]
    MODELS_MOVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_BEFORE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_AFTER_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    SHRINK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    worker_id: str
    rank: int
    successor: str
    successor_id: str
    bytes_moved: int
    tensors_moved: int
    models_moved: int
    seconds: float
    generation_before: int
    generation_after: int
    lost: _containers.RepeatedScalarFieldContainer[str]
    shrink: bool
    error: str
    finished_unix_time_s: float
    copy_seconds: float
    prepare_seconds: float
    def __init__(self, worker: _Optional[str] = ..., worker_id: _Optional[str] = ..., rank: _Optional[int] = ..., successor: _Optional[str] = ..., successor_id: _Optional[str] = ..., bytes_moved: _Optional[int] = ..., tensors_moved: _Optional[int] = ..., models_moved: _Optional[int] = ..., seconds: _Optional[float] = ..., generation_before: _Optional[int] = ..., generation_after: _Optional[int] = ..., lost: _Optional[_Iterable[str]] = ..., shrink: _Optional[bool] = ..., error: _Optional[str] = ..., finished_unix_time_s: _Optional[float] = ..., copy_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker", "shrink", "timeout_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SHRINK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker: str
    shrink: bool
    timeout_s: float
    def __init__(self, worker: _Optional[str] = ..., shrink: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class Cluster(_message.Message):
    __slots__ = ("generation", "formed", "world_size", "workers", "store_address", "version", "min_workers", "max_workers", "status", "op_timeout_s", "ready", "history", "leader", "store", "membership_digest", "handoff", "drains", "drains_completed", "drain_bytes_total")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FORMED_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    DRAINS_FIELD_NUMBER: _ClassVar[int]
    DRAINS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    generation: int
    formed: bool
    world_size: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    store_address: str
    version: int
    min_workers: int
    max_workers: int
    status: str
    op_timeout_s: float
    ready: bool
    history: _containers.RepeatedCompositeFieldContainer[GenerationRecord]
    leader: str
    store: str
    membership_digest: str
    handoff: Handoff
    drains: _containers.RepeatedCompositeFieldContainer[DrainReport]
    drains_completed: int
    drain_bytes_total: int
    def __init__(self, generation: _Optional[int] = ..., formed: _Optional[bool] = ..., world_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., store_address: _Optional[str] = ..., version: _Optional[int] = ..., min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ..., status: _Optional[str] = ..., op_timeout_s: _Optional[float] = ..., ready: _Optional[bool] = ..., history: _Optional[_Iterable[_Union[GenerationRecord, _Mapping]]] = ..., leader: _Optional[str] = ..., store: _Optional[str] = ..., membership_digest: _Optional[str] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ..., drains: _Optional[_Iterable[_Union[DrainReport, _Mapping]]] = ..., drains_completed: _Optional[int] = ..., drain_bytes_total: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("address", "hostname", "pid", "devices", "backend", "version", "last_generation", "retry_key", "store_port")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    RETRY_KEY_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    address: str
    hostname: str
    pid: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    version: str
    last_generation: int
    retry_key: str
    store_port: int
    def __init__(self, address: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., version: _Optional[str] = ..., last_generation: _Optional[int] = ..., retry_key: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s", "lease_s", "store_address", "op_timeout_s", "lease_secret")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    lease_s: float
    store_address: str
    op_timeout_s: float
    lease_secret: str
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., lease_s: _Optional[float] = ..., store_address: _Optional[str] = ..., op_timeout_s: _Optional[float] = ..., lease_secret: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "joined_generation", "busy", "status", "want_reply", "lease_secret", "handoff_result", "handoff_bytes_copied", "prepared_generation", "prepared_digest")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOINED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    WANT_REPLY_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_RESULT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    PREPARED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREPARED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    joined_generation: int
    busy: bool
    status: _status_pb2.WorkerStatus
    want_reply: bool
    lease_secret: str
    handoff_result: HandoffResult
    handoff_bytes_copied: int
    prepared_generation: int
    prepared_digest: str
    def __init__(self, worker_id: _Optional[str] = ..., joined_generation: _Optional[int] = ..., busy: _Optional[bool] = ..., status: _Optional[_Union[_status_pb2.WorkerStatus, _Mapping]] = ..., want_reply: _Optional[bool] = ..., lease_secret: _Optional[str] = ..., handoff_result: _Optional[_Union[HandoffResult, _Mapping]] = ..., handoff_bytes_copied: _Optional[int] = ..., prepared_generation: _Optional[int] = ..., prepared_digest: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation", "version")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    version: int
    def __init__(self, generation: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "lease_secret")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_secret: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_secret: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchClusterRequest(_message.Message):
    __slots__ = ("after_version",)
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    def __init__(self, after_version: _Optional[int] = ...) -> None: ...
