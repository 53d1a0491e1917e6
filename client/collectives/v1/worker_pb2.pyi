from collectives.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutTensorRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutTensorResponse(_message.Message):
    __slots__ = ("name", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class GetTensorRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetTensorResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ()
    def __init__(self) -> None: ...

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
    __slots__ = ("group_id", "generation", "timeout_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    generation: int
    timeout_s: float
    def __init__(self, group_id: _Optional[int] = ..., generation: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class BroadcastRequest(_message.Message):
    __slots__ = ("options", "name", "src")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    src: int
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., src: _Optional[int] = ...) -> None: ...

class AllReduceRequest(_message.Message):
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
    __slots__ = ("options", "name", "out")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    out: str
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., out: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("options", "name", "out")
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    name: str
    out: str
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ..., name: _Optional[str] = ..., out: _Optional[str] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: OpOptions
    def __init__(self, options: _Optional[_Union[OpOptions, _Mapping]] = ...) -> None: ...

class CollectiveResponse(_message.Message):
    __slots__ = ("op_id", "generation", "result_name", "result_ranks", "dtype", "shape", "latency_s")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESULT_NAME_FIELD_NUMBER: _ClassVar[int]
    RESULT_RANKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    generation: int
    result_name: str
    result_ranks: _containers.RepeatedScalarFieldContainer[int]
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    latency_s: float
    def __init__(self, op_id: _Optional[int] = ..., generation: _Optional[int] = ..., result_name: _Optional[str] = ..., result_ranks: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., latency_s: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("worker_id", "rank", "generation", "is_leader", "queue_depth", "tensors_held", "bytes_held", "ops_completed", "ops_failed", "devices", "backend")
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
    def __init__(self, worker_id: _Optional[str] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., is_leader: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., tensors_held: _Optional[int] = ..., bytes_held: _Optional[int] = ..., ops_completed: _Optional[int] = ..., ops_failed: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., backend: _Optional[str] = ...) -> None: ...

class OpDescriptor(_message.Message):
    __slots__ = ("op_id", "generation", "kind", "name", "out", "op", "root", "group_id", "group_ranks", "timeout_s")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    generation: int
    kind: str
    name: str
    out: str
    op: _tensor_pb2.ReduceOp
    root: int
    group_id: int
    group_ranks: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    def __init__(self, op_id: _Optional[int] = ..., generation: _Optional[int] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., out: _Optional[str] = ..., op: _Optional[_Union[_tensor_pb2.ReduceOp, str]] = ..., root: _Optional[int] = ..., group_id: _Optional[int] = ..., group_ranks: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...
