from collectives.v1 import flight_record_pb2 as _flight_record_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceStatus(_message.Message):
    __slots__ = ("device", "memory_used_bytes", "memory_total_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    memory_used_bytes: int
    memory_total_bytes: int
    def __init__(self, device: _Optional[str] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ...) -> None: ...

class OpCount(_message.Message):
    __slots__ = ("kind", "completed", "failed", "rate_per_s", "latency_p50_us", "latency_p99_us", "collective_bytes_received", "collective_bytes_sent")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P50_US_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P99_US_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    completed: int
    failed: int
    rate_per_s: float
    latency_p50_us: int
    latency_p99_us: int
    collective_bytes_received: int
    collective_bytes_sent: int
    def __init__(self, kind: _Optional[str] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., rate_per_s: _Optional[float] = ..., latency_p50_us: _Optional[int] = ..., latency_p99_us: _Optional[int] = ..., collective_bytes_received: _Optional[int] = ..., collective_bytes_sent: _Optional[int] = ...) -> None: ...

class ErrorGroup(_message.Message):
    __slots__ = ("kind", "code", "message", "count", "first_unix_time_s", "last_unix_time_s", "rate_per_s", "client", "last_op_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LAST_UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    LAST_OP_ID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    code: str
    message: str
    count: int
    first_unix_time_s: float
    last_unix_time_s: float
    rate_per_s: float
    client: str
    last_op_id: int
    def __init__(self, kind: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., count: _Optional[int] = ..., first_unix_time_s: _Optional[float] = ..., last_unix_time_s: _Optional[float] = ..., rate_per_s: _Optional[float] = ..., client: _Optional[str] = ..., last_op_id: _Optional[int] = ...) -> None: ...

class ClientStatus(_message.Message):
    __slots__ = ("peer", "user_agent", "name", "last_unix_time_s")
    PEER_FIELD_NUMBER: _ClassVar[int]
    USER_AGENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAST_UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    peer: str
    user_agent: str
    name: str
    last_unix_time_s: float
    def __init__(self, peer: _Optional[str] = ..., user_agent: _Optional[str] = ..., name: _Optional[str] = ..., last_unix_time_s: _Optional[float] = ...) -> None: ...

class RecentError(_message.Message):
    __slots__ = ("unix_time_s", "op_id", "generation", "kind", "code", "message")
    UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    unix_time_s: float
    op_id: int
    generation: int
    kind: str
    code: str
    message: str
    def __init__(self, unix_time_s: _Optional[float] = ..., op_id: _Optional[int] = ..., generation: _Optional[int] = ..., kind: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ModelVersion(_message.Message):
    __slots__ = ("name", "version", "batches", "batched_rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    batches: int
    batched_rows: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., batches: _Optional[int] = ..., batched_rows: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("tensors_held", "bytes_held", "models", "ops", "last_op", "last_op_latency_s", "queue_depth", "devices", "package_version", "torch_version", "backend_version", "bytes_received", "bytes_sent", "process_rss_bytes", "host_memory_total_bytes", "host_memory_available_bytes", "recent_errors", "data_collectives", "gradient_buckets_reduced", "graphs_retained", "model_versions", "model_versions_omitted", "error_groups", "clients", "recent_ops", "stuck")
    TENSORS_HELD_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    LAST_OP_FIELD_NUMBER: _ClassVar[int]
    LAST_OP_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PROCESS_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    DATA_COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BUCKETS_REDUCED_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_RETAINED_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSIONS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    RECENT_OPS_FIELD_NUMBER: _ClassVar[int]
    STUCK_FIELD_NUMBER: _ClassVar[int]
    tensors_held: int
    bytes_held: int
    models: _containers.RepeatedScalarFieldContainer[str]
    ops: _containers.RepeatedCompositeFieldContainer[OpCount]
    last_op: str
    last_op_latency_s: float
    queue_depth: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceStatus]
    package_version: str
    torch_version: str
    backend_version: str
    bytes_received: int
    bytes_sent: int
    process_rss_bytes: int
    host_memory_total_bytes: int
    host_memory_available_bytes: int
    recent_errors: _containers.RepeatedCompositeFieldContainer[RecentError]
    data_collectives: int
    gradient_buckets_reduced: int
    graphs_retained: int
    model_versions: _containers.RepeatedCompositeFieldContainer[ModelVersion]
    model_versions_omitted: int
    error_groups: _containers.RepeatedCompositeFieldContainer[ErrorGroup]
    clients: _containers.RepeatedCompositeFieldContainer[ClientStatus]
    recent_ops: _containers.RepeatedCompositeFieldContainer[_flight_record_pb2.FlightRecordOp]
    stuck: str
    def __init__(self, tensors_held: _Optional[int] = ..., bytes_held: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., ops: _Optional[_Iterable[_Union[OpCount, _Mapping]]] = ..., last_op: _Optional[str] = ..., last_op_latency_s: _Optional[float] = ..., queue_depth: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[DeviceStatus, _Mapping]]] = ..., package_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., backend_version: _Optional[str] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., process_rss_bytes: _Optional[int] = ..., host_memory_total_bytes: _Optional[int] = ..., host_memory_available_bytes: _Optional[int] = ..., recent_errors: _Optional[_Iterable[_Union[RecentError, _Mapping]]] = ..., data_collectives: _Optional[int] = ..., gradient_buckets_reduced: _Optional[int] = ..., graphs_retained: _Optional[int] = ..., model_versions: _Optional[_Iterable[_Union[ModelVersion, _Mapping]]] = ..., model_versions_omitted: _Optional[int] = ..., error_groups: _Optional[_Iterable[_Union[ErrorGroup, _Mapping]]] = ..., clients: _Optional[_Iterable[_Union[ClientStatus, _Mapping]]] = ..., recent_ops: _Optional[_Iterable[_Union[_flight_record_pb2.FlightRecordOp, _Mapping]]] = ..., stuck: _Optional[str] = ...) -> None: ...
