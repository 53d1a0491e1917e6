from collectives.v1 import flight_record_pb2 as _flight_record_pb2
from collectives.v1 import status_pb2 as _status_pb2
from collectives.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_MODE_UNSPECIFIED: _ClassVar[ModelMode]
    MODEL_MODE_TRAIN: _ClassVar[ModelMode]
    MODEL_MODE_EVAL: _ClassVar[ModelMode]

class OpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_KIND_UNSPECIFIED: _ClassVar[OpKind]
    OP_KIND_NOOP: _ClassVar[OpKind]
    OP_KIND_STOP: _ClassVar[OpKind]
    OP_KIND_BROADCAST: _ClassVar[OpKind]
    OP_KIND_ALL_REDUCE: _ClassVar[OpKind]
    OP_KIND_REDUCE: _ClassVar[OpKind]
    OP_KIND_ALL_GATHER: _ClassVar[OpKind]
    OP_KIND_GATHER: _ClassVar[OpKind]
    OP_KIND_REDUCE_SCATTER: _ClassVar[OpKind]
    OP_KIND_ALL_TO_ALL: _ClassVar[OpKind]
    OP_KIND_BARRIER: _ClassVar[OpKind]
    OP_KIND_NEW_GROUP: _ClassVar[OpKind]
    OP_KIND_ALL_REDUCE_GRADIENTS: _ClassVar[OpKind]
    OP_KIND_TRAIN_STEP: _ClassVar[OpKind]
    OP_KIND_EXCHANGE: _ClassVar[OpKind]
    OP_KIND_DESTROY_GROUP: _ClassVar[OpKind]
    OP_KIND_ALL_REDUCE_COALESCED: _ClassVar[OpKind]
    OP_KIND_BROADCAST_COALESCED: _ClassVar[OpKind]
    OP_KIND_ALL_GATHER_COALESCED: _ClassVar[OpKind]
    OP_KIND_ALL_TO_ALL_UNEVEN: _ClassVar[OpKind]
    OP_KIND_PUBLISH_MODEL: _ClassVar[OpKind]
    OP_KIND_REPLICATE: _ClassVar[OpKind]
    OP_KIND_STEP: _ClassVar[OpKind]
    OP_KIND_ZERO_GRAD: _ClassVar[OpKind]
MODEL_MODE_UNSPECIFIED: ModelMode
MODEL_MODE_TRAIN: ModelMode
MODEL_MODE_EVAL: ModelMode
OP_KIND_UNSPECIFIED: OpKind
OP_KIND_NOOP: OpKind
OP_KIND_STOP: OpKind
OP_KIND_BROADCAST: OpKind
OP_KIND_ALL_REDUCE: OpKind
OP_KIND_REDUCE: OpKind
OP_KIND_ALL_GATHER: OpKind
OP_KIND_GATHER: OpKind
OP_KIND_REDUCE_SCATTER: OpKind
OP_KIND_ALL_TO_ALL: OpKind
OP_KIND_BARRIER: OpKind
OP_KIND_NEW_GROUP: OpKind
OP_KIND_ALL_REDUCE_GRADIENTS: OpKind
OP_KIND_TRAIN_STEP: OpKind
OP_KIND_EXCHANGE: OpKind
OP_KIND_DESTROY_GROUP: OpKind
OP_KIND_ALL_REDUCE_COALESCED: OpKind
OP_KIND_BROADCAST_COALESCED: OpKind
OP_KIND_ALL_GATHER_COALESCED: OpKind
OP_KIND_ALL_TO_ALL_UNEVEN: OpKind
OP_KIND_PUBLISH_MODEL: OpKind
OP_KIND_REPLICATE: OpKind
OP_KIND_STEP: OpKind
OP_KIND_ZERO_GRAD: OpKind

class PutTensorRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutTensorResponse(_message.Message):
    __slots__ = ("name", "nbytes", "adopted", "returned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    nbytes: int
    adopted: bool
    returned: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., nbytes: _Optional[int] = ..., adopted: _Optional[bool] = ..., returned: _Optional[_Iterable[str]] = ...) -> None: ...

class ResultOf(_message.Message):
    __slots__ = ("generation", "op_id")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    generation: int
    op_id: int
    def __init__(self, generation: _Optional[int] = ..., op_id: _Optional[int] = ...) -> None: ...

class GetTensorRequest(_message.Message):
    __slots__ = ("name", "consume", "result_of")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONSUME_FIELD_NUMBER: _ClassVar[int]
    RESULT_OF_FIELD_NUMBER: _ClassVar[int]
    name: str
    consume: bool
    result_of: ResultOf
    def __init__(self, name: _Optional[str] = ..., consume: _Optional[bool] = ..., result_of: _Optional[_Union[ResultOf, _Mapping]] = ...) -> None: ...

class GetTensorResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutTensorShmRequest(_message.Message):
    __slots__ = ("header", "path", "offset", "hand_over", "lent")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    HAND_OVER_FIELD_NUMBER: _ClassVar[int]
    LENT_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    path: str
    offset: int
    hand_over: bool
    lent: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., hand_over: _Optional[bool] = ..., lent: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTensorShmRequest(_message.Message):
    __slots__ = ("name", "consume", "path", "offset", "result_of")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONSUME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RESULT_OF_FIELD_NUMBER: _ClassVar[int]
    name: str
    consume: bool
    path: str
    offset: int
    result_of: ResultOf
    def __init__(self, name: _Optional[str] = ..., consume: _Optional[bool] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., result_of: _Optional[_Union[ResultOf, _Mapping]] = ...) -> None: ...

class GetTensorShmResponse(_message.Message):
    __slots__ = ("header", "path", "offset")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    path: str
    offset: int
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class DataPlaneRequest(_message.Message):
    __slots__ = ("open_lane",)
    OPEN_LANE_FIELD_NUMBER: _ClassVar[int]
    open_lane: bool
    def __init__(self, open_lane: _Optional[bool] = ...) -> None: ...

class DataPlaneResponse(_message.Message):
    __slots__ = ("bulk_port", "bulk_min_bytes", "lane_ticket", "lane_methods", "bulk_tls")
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_TICKET_FIELD_NUMBER: _ClassVar[int]
    LANE_METHODS_FIELD_NUMBER: _ClassVar[int]
    BULK_TLS_FIELD_NUMBER: _ClassVar[int]
    bulk_port: int
    bulk_min_bytes: int
    lane_ticket: bytes
    lane_methods: _containers.RepeatedScalarFieldContainer[str]
    bulk_tls: bool
    def __init__(self, bulk_port: _Optional[int] = ..., bulk_min_bytes: _Optional[int] = ..., lane_ticket: _Optional[bytes] = ..., lane_methods: _Optional[_Iterable[str]] = ..., bulk_tls: _Optional[bool] = ...) -> None: ...

class PutTensorBulkRequest(_message.Message):
    __slots__ = ("header", "ticket")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    ticket: bytes
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class GetTensorBulkRequest(_message.Message):
    __slots__ = ("name", "consume", "result_of")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONSUME_FIELD_NUMBER: _ClassVar[int]
    RESULT_OF_FIELD_NUMBER: _ClassVar[int]
    name: str
    consume: bool
    result_of: ResultOf
    def __init__(self, name: _Optional[str] = ..., consume: _Optional[bool] = ..., result_of: _Optional[_Union[ResultOf, _Mapping]] = ...) -> None: ...

class GetTensorBulkResponse(_message.Message):
    __slots__ = ("header", "inline_data", "ticket", "ticket_ttl_s")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_TTL_S_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    inline_data: bytes
    ticket: bytes
    ticket_ttl_s: float
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., inline_data: _Optional[bytes] = ..., ticket: _Optional[bytes] = ..., ticket_ttl_s: _Optional[float] = ...) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("generation_after", "ahead", "ahead_snapshot")
    GENERATION_AFTER_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    generation_after: int
    ahead: bool
    ahead_snapshot: str
    def __init__(self, generation_after: _Optional[int] = ..., ahead: _Optional[bool] = ..., ahead_snapshot: _Optional[str] = ...) -> None: ...

class HandoffManifest(_message.Message):
    __slots__ = ("tensors", "bulk_port", "total_bytes", "models", "gradients", "unchanged", "ahead_snapshot", "model_builds")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    MODEL_BUILDS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorHeader]
    bulk_port: int
    total_bytes: int
    models: _containers.RepeatedScalarFieldContainer[str]
    gradients: _containers.RepeatedCompositeFieldContainer[HandoffGradient]
    unchanged: _containers.RepeatedScalarFieldContainer[str]
    ahead_snapshot: str
    model_builds: _containers.RepeatedCompositeFieldContainer[ModelSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorHeader, _Mapping]]] = ..., bulk_port: _Optional[int] = ..., total_bytes: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., gradients: _Optional[_Iterable[_Union[HandoffGradient, _Mapping]]] = ..., unchanged: _Optional[_Iterable[str]] = ..., ahead_snapshot: _Optional[str] = ..., model_builds: _Optional[_Iterable[_Union[ModelSpec, _Mapping]]] = ...) -> None: ...

class HandoffGradient(_message.Message):
    __slots__ = ("model", "header")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    model: str
    header: _tensor_pb2.TensorHeader
    def __init__(self, model: _Optional[str] = ..., header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ...) -> None: ...

class HandoffTensorsRequest(_message.Message):
    __slots__ = ("generation_after", "items", "ahead", "ahead_snapshot")
    GENERATION_AFTER_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    generation_after: int
    items: _containers.RepeatedCompositeFieldContainer[HandoffItem]
    ahead: bool
    ahead_snapshot: str
    def __init__(self, generation_after: _Optional[int] = ..., items: _Optional[_Iterable[_Union[HandoffItem, _Mapping]]] = ..., ahead: _Optional[bool] = ..., ahead_snapshot: _Optional[str] = ...) -> None: ...

class HandoffItem(_message.Message):
    __slots__ = ("name", "model", "archive")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    archive: bool
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., archive: _Optional[bool] = ...) -> None: ...

class HandoffTensorsResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[GetTensorBulkResponse]
    def __init__(self, tensors: _Optional[_Iterable[_Union[GetTensorBulkResponse, _Mapping]]] = ...) -> None: ...

class DeleteTensorRequest(_message.Message):
    __slots__ = ("name", "missing_ok")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    name: str
    missing_ok: bool
    def __init__(self, name: _Optional[str] = ..., missing_ok: _Optional[bool] = ...) -> None: ...

class DeleteTensorResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class ListTensorsRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "device")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    device: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class ListTensorsResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ...) -> None: ...

class OpOptions(_message.Message):
    __slots__ = ("group_id", "generation", "timeout_s", "membership_digest", "reissued_from")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REISSUED_FROM_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    generation: int
    timeout_s: float
    membership_digest: str
    reissued_from: int
    def __init__(self, group_id: _Optional[int] = ..., generation: _Optional[int] = ..., timeout_s: _Optional[float] = ..., membership_digest: _Optional[str] = ..., reissued_from: _Optional[int] = ...) -> None: ...

class BroadcastRequest(_message.Message):
    __slots__ = ("options", "name", "src", "names")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    src: int
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., src: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class AllReduceRequest(_message.Message):
    __slots__ = ("options", "name", "op", "out", "names", "outs")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    OUTS_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    op: _tensor_pb2.ReduceOp
    out: str
    names: _containers.RepeatedScalarFieldContainer[str]
    outs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., op: _Optional[_Union[_tensor_pb2.ReduceOp, str]] = ..., out: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., outs: _Optional[_Iterable[str]] = ...) -> None: ...

class ReduceRequest(_message.Message):
    __slots__ = ("options", "name", "dst", "op", "out")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    dst: int
    op: _tensor_pb2.ReduceOp
    out: str
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., dst: _Optional[int] = ..., op: _Optional[_Union[_tensor_pb2.ReduceOp, str]] = ..., out: _Optional[str] = ...) -> None: ...

class AllGatherRequest(_message.Message):
    __slots__ = ("options", "name", "out", "names", "outs")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    OUTS_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    out: str
    names: _containers.RepeatedScalarFieldContainer[str]
    outs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., out: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., outs: _Optional[_Iterable[str]] = ...) -> None: ...

class GatherRequest(_message.Message):
    __slots__ = ("options", "name", "dst", "out")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    dst: int
    out: str
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., dst: _Optional[int] = ..., out: _Optional[str] = ...) -> None: ...

class ReduceScatterRequest(_message.Message):
    __slots__ = ("options", "name", "op", "out")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    op: _tensor_pb2.ReduceOp
    out: str
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., op: _Optional[_Union[_tensor_pb2.ReduceOp, str]] = ..., out: _Optional[str] = ...) -> None: ...

class AllToAllRequest(_message.Message):
    __slots__ = ("options", "name", "out", "split_sizes")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SIZES_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    out: str
    split_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., out: _Optional[str] = ..., split_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class ExchangePair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("options", "name", "out", "pairs")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    out: str
    pairs: _containers.RepeatedCompositeFieldContainer[ExchangePair]
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., out: _Optional[str] = ..., pairs: _Optional[_Iterable[_Union[ExchangePair, _Mapping]]] = ...) -> None: ...

class DestroyGroupRequest(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ...) -> None: ...

class DestroyGroupResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ...) -> None: ...

class CollectiveResponse(_message.Message):
    __slots__ = ("op_id", "generation", "result_name", "result_ranks", "dtype", "shape", "latency_s", "result_names")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESULT_NAME_FIELD_NUMBER: _ClassVar[int]
    RESULT_RANKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    RESULT_NAMES_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    generation: int
    result_name: str
    result_ranks: _containers.RepeatedScalarFieldContainer[int]
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    latency_s: float
    result_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, op_id: _Optional[int] = ..., generation: _Optional[int] = ..., result_name: _Optional[str] = ..., result_ranks: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., latency_s: _Optional[float] = ..., result_names: _Optional[_Iterable[str]] = ...) -> None: ...

class NewGroupRequest(_message.Message):
    __slots__ = ("options", "ranks")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class NewGroupResponse(_message.Message):
    __slots__ = ("group_id", "generation", "ranks")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    generation: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_id: _Optional[int] = ..., generation: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("worker_id", "rank", "generation", "is_leader", "queue_depth", "tensors_held", "bytes_held", "ops_completed", "ops_failed", "devices", "backend", "status", "address", "hostname", "pid", "uptime_s", "world_size", "membership_digest", "coordinator")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_HELD_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    OPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    OPS_FAILED_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rank: int
    generation: int
    is_leader: bool
    queue_depth: int
    tensors_held: int
    bytes_held: int
    ops_completed: int
    ops_failed: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    backend: str
    status: _status_pb2.WorkerStatus
    address: str
    hostname: str
    pid: int
    uptime_s: float
    world_size: int
    membership_digest: str
    coordinator: str
    def __init__(self, worker_id: _Optional[str] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., is_leader: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., tensors_held: _Optional[int] = ..., bytes_held: _Optional[int] = ..., ops_completed: _Optional[int] = ..., ops_failed: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ..., status: _Optional[_Union[_status_pb2.WorkerStatus, _Mapping]] = ..., address: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., world_size: _Optional[int] = ..., membership_digest: _Optional[str] = ..., coordinator: _Optional[str] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("name", "factory", "factory_kwargs_json", "archive_nbytes", "archive_tensor", "batching", "mode", "load_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FACTORY_FIELD_NUMBER: _ClassVar[int]
    FACTORY_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_TENSOR_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    factory: str
    factory_kwargs_json: str
    archive_nbytes: int
    archive_tensor: str
    batching: ForwardBatching
    mode: ModelMode
    load_id: str
    def __init__(self, name: _Optional[str] = ..., factory: _Optional[str] = ..., factory_kwargs_json: _Optional[str] = ..., archive_nbytes: _Optional[int] = ..., archive_tensor: _Optional[str] = ..., batching: _Optional[_Union[ForwardBatching, _Mapping]] = ..., mode: _Optional[_Union[ModelMode, str]] = ..., load_id: _Optional[str] = ...) -> None: ...

class ForwardBatching(_message.Message):
    __slots__ = ("max_rows", "max_delay_ms")
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    max_rows: int
    max_delay_ms: float
    def __init__(self, max_rows: _Optional[int] = ..., max_delay_ms: _Optional[float] = ...) -> None: ...

class BatchingStats(_message.Message):
    __slots__ = ("batches", "calls", "rows", "largest_rows")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LARGEST_ROWS_FIELD_NUMBER: _ClassVar[int]
    batches: int
    calls: int
    rows: int
    largest_rows: int
    def __init__(self, batches: _Optional[int] = ..., calls: _Optional[int] = ..., rows: _Optional[int] = ..., largest_rows: _Optional[int] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("spec", "archive_chunk")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    spec: ModelSpec
    archive_chunk: bytes
    def __init__(self, spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., archive_chunk: _Optional[bytes] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "parameters", "parameter_bytes", "devices", "source", "optimizer", "graphs_retained", "steps", "version", "training", "batching", "batching_stats", "batch_statistics", "running_statistics", "load_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_RETAINED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    BATCHING_STATS_FIELD_NUMBER: _ClassVar[int]
    BATCH_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    parameters: int
    parameter_bytes: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    source: str
    optimizer: str
    graphs_retained: int
    steps: int
    version: int
    training: bool
    batching: ForwardBatching
    batching_stats: BatchingStats
    batch_statistics: bool
    running_statistics: bool
    load_id: str
    def __init__(self, name: _Optional[str] = ..., parameters: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ..., optimizer: _Optional[str] = ..., graphs_retained: _Optional[int] = ..., steps: _Optional[int] = ..., version: _Optional[int] = ..., training: _Optional[bool] = ..., batching: _Optional[_Union[ForwardBatching, _Mapping]] = ..., batching_stats: _Optional[_Union[BatchingStats, _Mapping]] = ..., batch_statistics: _Optional[bool] = ..., running_statistics: _Optional[bool] = ..., load_id: _Optional[str] = ...) -> None: ...

class SetModelModeRequest(_message.Message):
    __slots__ = ("name", "mode")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    mode: ModelMode
    def __init__(self, name: _Optional[str] = ..., mode: _Optional[_Union[ModelMode, str]] = ...) -> None: ...

class SetModelModeResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name", "missing_ok")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    name: str
    missing_ok: bool
    def __init__(self, name: _Optional[str] = ..., missing_ok: _Optional[bool] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("tensor", "int_value", "float_value", "str_value", "bool_value", "none", "list", "tuple", "dict", "named_tuple", "inline_tensor")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STR_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    NAMED_TUPLE_FIELD_NUMBER: _ClassVar[int]
    INLINE_TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    int_value: int
    float_value: float
    str_value: str
    bool_value: bool
    none: bool
    list: ValueList
    tuple: ValueList
    dict: ValueDict
    named_tuple: NamedTupleValue
    inline_tensor: InlineTensor
    def __init__(self, tensor: _Optional[str] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., str_value: _Optional[str] = ..., bool_value: _Optional[bool] = ..., none: _Optional[bool] = ..., list: _Optional[_Union[ValueList, _Mapping]] = ..., tuple: _Optional[_Union[ValueList, _Mapping]] = ..., dict: _Optional[_Union[ValueDict, _Mapping]] = ..., named_tuple: _Optional[_Union[NamedTupleValue, _Mapping]] = ..., inline_tensor: _Optional[_Union[InlineTensor, _Mapping]] = ...) -> None: ...

class InlineTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: _tensor_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ValueList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class ValueDict(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class NamedTupleValue(_message.Message):
    __slots__ = ("type_name", "fields", "values")
    TYPE_NAME_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    type_name: str
    fields: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, type_name: _Optional[str] = ..., fields: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("model", "call_id", "args", "kwargs", "grad_enabled", "input_grad_names", "inline_output_bytes", "version", "mode", "output_names", "routed", "load_id", "statistics_counted")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    GRAD_ENABLED_FIELD_NUMBER: _ClassVar[int]
    INPUT_GRAD_NAMES_FIELD_NUMBER: _ClassVar[int]
    INLINE_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NAMES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_COUNTED_FIELD_NUMBER: _ClassVar[int]
    model: str
    call_id: str
    args: Value
    kwargs: Value
    grad_enabled: bool
    input_grad_names: _containers.RepeatedScalarFieldContainer[str]
    inline_output_bytes: int
    version: int
    mode: ModelMode
    output_names: _containers.RepeatedScalarFieldContainer[str]
    routed: bool
    load_id: str
    statistics_counted: bool
    def __init__(self, model: _Optional[str] = ..., call_id: _Optional[str] = ..., args: _Optional[_Union[Value, _Mapping]] = ..., kwargs: _Optional[_Union[Value, _Mapping]] = ..., grad_enabled: _Optional[bool] = ..., input_grad_names: _Optional[_Iterable[str]] = ..., inline_output_bytes: _Optional[int] = ..., version: _Optional[int] = ..., mode: _Optional[_Union[ModelMode, str]] = ..., output_names: _Optional[_Iterable[str]] = ..., routed: _Optional[bool] = ..., load_id: _Optional[str] = ..., statistics_counted: _Optional[bool] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("output", "latency_s", "version", "forwards_in_flight", "replicas_may_differ", "load_id")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_MAY_DIFFER_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    output: Value
    latency_s: float
    version: int
    forwards_in_flight: int
    replicas_may_differ: bool
    load_id: str
    def __init__(self, output: _Optional[_Union[Value, _Mapping]] = ..., latency_s: _Optional[float] = ..., version: _Optional[int] = ..., forwards_in_flight: _Optional[int] = ..., replicas_may_differ: _Optional[bool] = ..., load_id: _Optional[str] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("model", "call_id", "output_names", "grad_names", "inline_grads", "inline_output_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NAMES_FIELD_NUMBER: _ClassVar[int]
    GRAD_NAMES_FIELD_NUMBER: _ClassVar[int]
    INLINE_GRADS_FIELD_NUMBER: _ClassVar[int]
    INLINE_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    call_id: str
    output_names: _containers.RepeatedScalarFieldContainer[str]
    grad_names: _containers.RepeatedScalarFieldContainer[str]
    inline_grads: _containers.RepeatedCompositeFieldContainer[InlineTensor]
    inline_output_bytes: int
    def __init__(self, model: _Optional[str] = ..., call_id: _Optional[str] = ..., output_names: _Optional[_Iterable[str]] = ..., grad_names: _Optional[_Iterable[str]] = ..., inline_grads: _Optional[_Iterable[_Union[InlineTensor, _Mapping]]] = ..., inline_output_bytes: _Optional[int] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ("input_grad_names", "inline_input_grads", "latency_s")
    INPUT_GRAD_NAMES_FIELD_NUMBER: _ClassVar[int]
    INLINE_INPUT_GRADS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    input_grad_names: _containers.RepeatedScalarFieldContainer[str]
    inline_input_grads: _containers.RepeatedCompositeFieldContainer[InlineTensor]
    latency_s: float
    def __init__(self, input_grad_names: _Optional[_Iterable[str]] = ..., inline_input_grads: _Optional[_Iterable[_Union[InlineTensor, _Mapping]]] = ..., latency_s: _Optional[float] = ...) -> None: ...

class ReleaseGraphRequest(_message.Message):
    __slots__ = ("model", "call_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    call_id: str
    def __init__(self, model: _Optional[str] = ..., call_id: _Optional[str] = ...) -> None: ...

class ReleaseGraphResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ZeroGradRequest(_message.Message):
    __slots__ = ("model", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    options: OpOptions
    def __init__(self, model: _Optional[str] = ..., options: _Optional[_Union[OpOptions, _Mapping]] = ...) -> None: ...

class ZeroGradResponse(_message.Message):
    __slots__ = ("op_id",)
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    def __init__(self, op_id: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("model", "optimizer", "hyper_json", "max_grad_norm", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    HYPER_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    optimizer: str
    hyper_json: str
    max_grad_norm: float
    options: OpOptions
    def __init__(self, model: _Optional[str] = ..., optimizer: _Optional[str] = ..., hyper_json: _Optional[str] = ..., max_grad_norm: _Optional[float] = ..., options: _Optional[_Union[OpOptions, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("steps", "op_id", "generation", "version")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    steps: int
    op_id: int
    generation: int
    version: int
    def __init__(self, steps: _Optional[int] = ..., op_id: _Optional[int] = ..., generation: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class ModelTensorsRequest(_message.Message):
    __slots__ = ("model", "which")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WHICH_FIELD_NUMBER: _ClassVar[int]
    model: str
    which: str
    def __init__(self, model: _Optional[str] = ..., which: _Optional[str] = ...) -> None: ...

class LoadStateDictResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    def __init__(self, tensors: _Optional[int] = ...) -> None: ...

class AllReduceGradientsRequest(_message.Message):
    __slots__ = ("options", "model", "op", "bucket_bytes")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    model: str
    op: _tensor_pb2.ReduceOp
    bucket_bytes: int
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., model: _Optional[str] = ..., op: _Optional[_Union[_tensor_pb2.ReduceOp, str]] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class AllReduceGradientsResponse(_message.Message):
    __slots__ = ("op_id", "generation", "buckets", "bytes", "latency_s")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    generation: int
    buckets: int
    bytes: int
    latency_s: float
    def __init__(self, op_id: _Optional[int] = ..., generation: _Optional[int] = ..., buckets: _Optional[int] = ..., bytes: _Optional[int] = ..., latency_s: _Optional[float] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("options", "model", "inputs", "targets", "loss", "optimizer", "hyper_json", "bucket_bytes", "max_grad_norm")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    HYPER_JSON_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    model: str
    inputs: str
    targets: str
    loss: str
    optimizer: str
    hyper_json: str
    bucket_bytes: int
    max_grad_norm: float
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., model: _Optional[str] = ..., inputs: _Optional[str] = ..., targets: _Optional[str] = ..., loss: _Optional[str] = ..., optimizer: _Optional[str] = ..., hyper_json: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("op_id", "generation", "loss", "rank_losses", "buckets", "latency_s")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    RANK_LOSSES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    generation: int
    loss: float
    rank_losses: _containers.RepeatedScalarFieldContainer[float]
    buckets: int
    latency_s: float
    def __init__(self, op_id: _Optional[int] = ..., generation: _Optional[int] = ..., loss: _Optional[float] = ..., rank_losses: _Optional[_Iterable[float]] = ..., buckets: _Optional[int] = ..., latency_s: _Optional[float] = ...) -> None: ...

class PublishModelRequest(_message.Message):
    __slots__ = ("options", "model", "prefix", "strict", "cast")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    CAST_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    model: str
    prefix: str
    strict: bool
    cast: bool
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., model: _Optional[str] = ..., prefix: _Optional[str] = ..., strict: _Optional[bool] = ..., cast: _Optional[bool] = ...) -> None: ...

class ReplicateTensorRequest(_message.Message):
    __slots__ = ("options", "upload", "name")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    upload: str
    name: str
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., upload: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class PublishModelResponse(_message.Message):
    __slots__ = ("op_id", "generation", "version", "tensors", "bytes", "latency_s")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    generation: int
    version: int
    tensors: int
    bytes: int
    latency_s: float
    def __init__(self, op_id: _Optional[int] = ..., generation: _Optional[int] = ..., version: _Optional[int] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., latency_s: _Optional[float] = ...) -> None: ...

class TensorOpArgs(_message.Message):
    __slots__ = ("name", "out", "op", "root")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    name: str
    out: str
    op: _tensor_pb2.ReduceOp
    root: int
    def __init__(self, name: _Optional[str] = ..., out: _Optional[str] = ..., op: _Optional[_Union[_tensor_pb2.ReduceOp, str]] = ..., root: _Optional[int] = ...) -> None: ...

class CoalescedArgs(_message.Message):
    __slots__ = ("names", "outs", "op", "root")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    OUTS_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    outs: _containers.RepeatedScalarFieldContainer[str]
    op: _tensor_pb2.ReduceOp
    root: int
    def __init__(self, names: _Optional[_Iterable[str]] = ..., outs: _Optional[_Iterable[str]] = ..., op: _Optional[_Union[_tensor_pb2.ReduceOp, str]] = ..., root: _Optional[int] = ...) -> None: ...

class UnevenAllToAllArgs(_message.Message):
    __slots__ = ("name", "out", "split_sizes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SIZES_FIELD_NUMBER: _ClassVar[int]
    name: str
    out: str
    split_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., out: _Optional[str] = ..., split_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class ExchangeArgs(_message.Message):
    __slots__ = ("name", "out", "srcs", "dsts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    SRCS_FIELD_NUMBER: _ClassVar[int]
    DSTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    out: str
    srcs: _containers.RepeatedScalarFieldContainer[int]
    dsts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., out: _Optional[str] = ..., srcs: _Optional[_Iterable[int]] = ..., dsts: _Optional[_Iterable[int]] = ...) -> None: ...

class DestroyGroupArgs(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    def __init__(self, group_id: _Optional[int] = ...) -> None: ...

class NewGroupArgs(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class GradientsArgs(_message.Message):
    __slots__ = ("model", "op", "bucket_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    op: _tensor_pb2.ReduceOp
    bucket_bytes: int
    def __init__(self, model: _Optional[str] = ..., op: _Optional[_Union[_tensor_pb2.ReduceOp, str]] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class PublishArgs(_message.Message):
    __slots__ = ("model", "root", "prefix", "entries", "strict", "cast")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    CAST_FIELD_NUMBER: _ClassVar[int]
    model: str
    root: int
    prefix: str
    entries: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorHeader]
    strict: bool
    cast: bool
    def __init__(self, model: _Optional[str] = ..., root: _Optional[int] = ..., prefix: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[_tensor_pb2.TensorHeader, _Mapping]]] = ..., strict: _Optional[bool] = ..., cast: _Optional[bool] = ...) -> None: ...

class TrainStepArgs(_message.Message):
    __slots__ = ("model", "inputs", "targets", "loss", "optimizer", "hyper_json", "bucket_bytes", "max_grad_norm")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    HYPER_JSON_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: str
    targets: str
    loss: str
    optimizer: str
    hyper_json: str
    bucket_bytes: int
    max_grad_norm: float
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[str] = ..., targets: _Optional[str] = ..., loss: _Optional[str] = ..., optimizer: _Optional[str] = ..., hyper_json: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class Announcement(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[AnnouncedOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[AnnouncedOp, _Mapping]]] = ...) -> None: ...

class AnnouncedOp(_message.Message):
    __slots__ = ("op", "inline_capacity")
    OP_FIELD_NUMBER: _ClassVar[int]
    INLINE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    op: OpDescriptor
    inline_capacity: int
    def __init__(self, op: _Optional[_Union[OpDescriptor, _Mapping]] = ..., inline_capacity: _Optional[int] = ...) -> None: ...

class OpDescriptor(_message.Message):
    __slots__ = ("op_id", "generation", "group_id", "timeout_s", "kind", "tensor", "new_group", "gradients", "train_step", "coalesced", "uneven", "exchange", "destroy_group", "publish", "replicate", "step", "zero_grad", "membership_digest")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    NEW_GROUP_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FIELD_NUMBER: _ClassVar[int]
    UNEVEN_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    DESTROY_GROUP_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ZERO_GRAD_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    generation: int
    group_id: int
    timeout_s: float
    kind: OpKind
    tensor: TensorOpArgs
    new_group: NewGroupArgs
    gradients: GradientsArgs
    train_step: TrainStepArgs
    coalesced: CoalescedArgs
    uneven: UnevenAllToAllArgs
    exchange: ExchangeArgs
    destroy_group: DestroyGroupArgs
    publish: PublishArgs
    replicate: TensorOpArgs
    step: StepRequest
    zero_grad: ZeroGradRequest
    membership_digest: str
    def __init__(self, op_id: _Optional[int] = ..., generation: _Optional[int] = ..., group_id: _Optional[int] = ..., timeout_s: _Optional[float] = ..., kind: _Optional[_Union[OpKind, str]] = ..., tensor: _Optional[_Union[TensorOpArgs, _Mapping]] = ..., new_group: _Optional[_Union[NewGroupArgs, _Mapping]] = ..., gradients: _Optional[_Union[GradientsArgs, _Mapping]] = ..., train_step: _Optional[_Union[TrainStepArgs, _Mapping]] = ..., coalesced: _Optional[_Union[CoalescedArgs, _Mapping]] = ..., uneven: _Optional[_Union[UnevenAllToAllArgs, _Mapping]] = ..., exchange: _Optional[_Union[ExchangeArgs, _Mapping]] = ..., destroy_group: _Optional[_Union[DestroyGroupArgs, _Mapping]] = ..., publish: _Optional[_Union[PublishArgs, _Mapping]] = ..., replicate: _Optional[_Union[TensorOpArgs, _Mapping]] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ..., zero_grad: _Optional[_Union[ZeroGradRequest, _Mapping]] = ..., membership_digest: _Optional[str] = ...) -> None: ...
