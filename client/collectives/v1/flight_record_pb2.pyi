from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FlightRecordRequest(_message.Message):
    __slots__ = ("last", "before_seq")
    LAST_FIELD_NUMBER: _ClassVar[int]
    BEFORE_SEQ_FIELD_NUMBER: _ClassVar[int]
    last: int
    before_seq: int
    def __init__(self, last: _Optional[int] = ..., before_seq: _Optional[int] = ...) -> None: ...

class FlightRecordOp(_message.Message):
    __slots__ = ("op_id", "generation", "kind", "names", "ranks", "client", "admitted_s", "announced_s", "started_s", "finished_s", "code", "message", "nbytes", "dtype", "rank", "call_id", "names_omitted", "message_chars_omitted")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_S_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_S_FIELD_NUMBER: _ClassVar[int]
    STARTED_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_S_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_OMITTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_CHARS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    generation: int
    kind: str
    names: _containers.RepeatedScalarFieldContainer[str]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    client: str
    admitted_s: float
    announced_s: float
    started_s: float
    finished_s: float
    code: int
    message: str
    nbytes: int
    dtype: str
    rank: int
    call_id: str
    names_omitted: int
    message_chars_omitted: int
    def __init__(self, op_id: _Optional[int] = ..., generation: _Optional[int] = ..., kind: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., ranks: _Optional[_Iterable[int]] = ..., client: _Optional[str] = ..., admitted_s: _Optional[float] = ..., announced_s: _Optional[float] = ..., started_s: _Optional[float] = ..., finished_s: _Optional[float] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[str] = ..., rank: _Optional[int] = ..., call_id: _Optional[str] = ..., names_omitted: _Optional[int] = ..., message_chars_omitted: _Optional[int] = ...) -> None: ...

class FlightRecordResponse(_message.Message):
    __slots__ = ("rank", "generation", "worker_id", "address", "now_s", "capacity", "op_timeout_s", "ops", "first_seq", "older")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NOW_S_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    OP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    OLDER_FIELD_NUMBER: _ClassVar[int]
    rank: int
    generation: int
    worker_id: str
    address: str
    now_s: float
    capacity: int
    op_timeout_s: float
    ops: _containers.RepeatedCompositeFieldContainer[FlightRecordOp]
    first_seq: int
    older: int
    def __init__(self, rank: _Optional[int] = ..., generation: _Optional[int] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., now_s: _Optional[float] = ..., capacity: _Optional[int] = ..., op_timeout_s: _Optional[float] = ..., ops: _Optional[_Iterable[_Union[FlightRecordOp, _Mapping]]] = ..., first_seq: _Optional[int] = ..., older: _Optional[int] = ...) -> None: ...
