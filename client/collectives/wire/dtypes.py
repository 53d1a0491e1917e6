"""Mapping between torch dtypes and the wire enum ``collectives.v1.DType``."""

from __future__ import annotations

import torch

from collectives.errors import InvalidArgument
from collectives.v1 import tensor_pb2

__all__ = ["to_wire", "from_wire", "SUPPORTED_DTYPES", "itemsize"]

_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.int8: tensor_pb2.DTYPE_INT8,
    torch.int16: tensor_pb2.DTYPE_INT16,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.bool: tensor_pb2.DTYPE_BOOL,
    torch.complex64: tensor_pb2.DTYPE_COMPLEX64,
    torch.complex128: tensor_pb2.DTYPE_COMPLEX128,
}
_FROM_WIRE: dict[int, torch.dtype] = {v: k for k, v in _TO_WIRE.items()}

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_TO_WIRE)


def to_wire(dtype: torch.dtype) -> int:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise InvalidArgument(f"dtype {dtype} is not supported; use one of: {supported}") from None


def from_wire(value: int) -> torch.dtype:
    try:
        return _FROM_WIRE[value]
    except KeyError:
        raise InvalidArgument(
            f"unknown dtype enum value {value}; see collectives.v1.DType for valid values"
        ) from None


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
