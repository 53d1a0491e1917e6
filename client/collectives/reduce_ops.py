"""Reduce operators: the public enum, parsing, and which dtypes admit which op."""

from __future__ import annotations

import enum

import torch

from collectives.errors import InvalidArgument
from collectives.v1 import tensor_pb2

__all__ = ["ReduceOp", "parse_reduce_op", "check_op_for_dtype"]


class ReduceOp(enum.Enum):
    """Reduction operators, as ``torch.distributed.ReduceOp``."""

    SUM = tensor_pb2.REDUCE_OP_SUM
    PRODUCT = tensor_pb2.REDUCE_OP_PRODUCT
    MIN = tensor_pb2.REDUCE_OP_MIN
    MAX = tensor_pb2.REDUCE_OP_MAX
    AVG = tensor_pb2.REDUCE_OP_AVG
    BAND = tensor_pb2.REDUCE_OP_BAND
    BOR = tensor_pb2.REDUCE_OP_BOR
    BXOR = tensor_pb2.REDUCE_OP_BXOR

    @property
    def wire(self) -> int:
        return int(self.value)

    @classmethod
    def from_wire(cls, value: int) -> ReduceOp:
        if value == tensor_pb2.REDUCE_OP_UNSPECIFIED:
            return cls.SUM
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(
                f"unknown reduce op enum value {value}; valid: "
                + ", ".join(f"{m.name.lower()}={m.value}" for m in cls)
            ) from None


def parse_reduce_op(op: object) -> ReduceOp:
    """Accepts ``"sum"``, ``ReduceOp.SUM`` or ``torch.distributed.ReduceOp.SUM``."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.strip().upper()]
        except KeyError:
            raise InvalidArgument(
                f"unknown reduce op {op!r}; use one of: "
                + ", ".join(m.name.lower() for m in ReduceOp)
            ) from None
    name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
    if isinstance(name, str) and name.upper() in ReduceOp.__members__:
        return ReduceOp[name.upper()]
    raise InvalidArgument(f"reduce op must be a str or collectives.ReduceOp, got {op!r}")


def check_op_for_dtype(op: ReduceOp, dtype: torch.dtype) -> None:
    """Raises :class:`InvalidArgument` when ``dtype`` does not admit ``op``."""
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and (
        dtype.is_floating_point or dtype.is_complex
    ):
        raise InvalidArgument(
            f"reduce op {op.name.lower()} is bitwise and needs an integer or bool tensor, "
            f"got {dtype}; use sum/product/min/max/avg for floating tensors"
        )
    if op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgument(
            f"reduce op avg needs a floating or complex tensor, got {dtype}; "
            "use sum and divide, or convert the tensor to a floating dtype"
        )
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise InvalidArgument(
            f"reduce op {op.name.lower()} is undefined for complex tensors ({dtype})"
        )
