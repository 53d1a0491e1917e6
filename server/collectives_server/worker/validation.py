"""Cross-rank operand validation: pure decisions, no I/O.

Before any data moves, every rank contributes a small int64 vector describing
its operand (present?, dtype, shape); the vectors are all-gathered and every
rank calls :func:`decide` on the same inputs, so every rank reaches the same
verdict and fails (or proceeds) together with one message. torch.distributed
does not check shapes across ranks and silently returns garbage; we refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from collectives.dtypes import from_wire, to_wire
from collectives.errors import InvalidArgument
from collectives.reduce_ops import ReduceOp, check_op_for_dtype

__all__ = [
    "ABSENT",
    "PRESENT",
    "NOT_MEMBER",
    "INFO_LEN",
    "OperandInfo",
    "OpError",
    "Plan",
    "encode_info",
    "decode_info",
    "decide",
    "REDUCING_KINDS",
    "KINDS",
]

ABSENT, PRESENT, NOT_MEMBER = 0, 1, 2
MAX_DIMS = 64
INFO_LEN = 3 + MAX_DIMS

KINDS = (
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "reduce_scatter",
    "all_to_all",
    "barrier",
)
REDUCING_KINDS = ("all_reduce", "reduce", "reduce_scatter")


@dataclass(frozen=True)
class OperandInfo:
    state: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.state != PRESENT or self.dtype is None:
            return "absent"
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True)
class OpError:
    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class Plan:
    """What the op will do: the operand's dtype and shape (for broadcast: src's)."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]


def encode_info(t: torch.Tensor | None, member: bool) -> torch.Tensor:
    v = torch.zeros(INFO_LEN, dtype=torch.int64)
    if not member:
        v[0] = NOT_MEMBER
    elif t is not None:
        if t.dim() > MAX_DIMS:  # the codec refuses these at put time; defensive
            raise InvalidArgument(f"tensor has {t.dim()} dims; at most {MAX_DIMS} supported")
        v[0] = PRESENT
        v[1] = to_wire(t.dtype)
        v[2] = t.dim()
        if t.dim():
            v[3 : 3 + t.dim()] = torch.tensor(list(t.shape), dtype=torch.int64)
    return v


def decode_info(v: torch.Tensor) -> OperandInfo:
    values = v.tolist()
    state = int(values[0])
    if state != PRESENT:
        return OperandInfo(state)
    ndim = int(values[2])
    return OperandInfo(
        PRESENT, from_wire(int(values[1])), tuple(int(d) for d in values[3 : 3 + ndim])
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def decide(
    kind: str,
    name: str,
    members: list[int],
    infos: list[OperandInfo],
    root: int = 0,
    op: ReduceOp = ReduceOp.SUM,
) -> Plan | OpError:
    """The verdict every rank reaches for one op.

    ``members`` are the group's global ranks in ascending order; ``infos`` is
    indexed by global rank (non-members included, ignored).
    """
    if kind == "barrier":
        return Plan(None, ())
    required = [root] if kind == "broadcast" else members
    missing = [r for r in required if infos[r].state != PRESENT]
    if missing:
        if kind == "broadcast":
            holders = [r for r in members if infos[r].state == PRESENT]
            if not holders:
                return OpError(
                    grpc.StatusCode.NOT_FOUND,
                    f"tensor {name!r} not found on any rank of the group (ranks "
                    f"{_ranks(members)}); put it on src rank {root} before broadcasting",
                )
            return OpError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tensor {name!r} is missing on src rank {root} (present on rank(s) "
                f"{_ranks(holders)}); broadcast needs it on the src rank",
            )
        if len(missing) == len(required):
            return OpError(
                grpc.StatusCode.NOT_FOUND,
                f"tensor {name!r} not found on any rank of the group (ranks {_ranks(members)})",
            )
        return OpError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"tensor {name!r} is missing on rank(s) {_ranks(missing)} but present on "
            f"rank(s) {_ranks([r for r in required if r not in missing])}; {kind} needs it "
            "on every rank of the group",
        )
    reference = infos[required[0]]
    if kind != "broadcast":
        differing = [
            r
            for r in required
            if (infos[r].dtype, infos[r].shape) != (reference.dtype, reference.shape)
        ]
        if differing:
            described = "; ".join(f"rank {r}: {infos[r].describe()}" for r in required)
            return OpError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tensor {name!r} disagrees across ranks ({described}); {kind} needs the same "
                "dtype and shape on every rank",
            )
    assert reference.dtype is not None
    if kind in REDUCING_KINDS:
        try:
            check_op_for_dtype(op, reference.dtype)
        except InvalidArgument as exc:
            return OpError(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {name!r}: {exc.message}")
    if kind in ("reduce_scatter", "all_to_all"):
        size = len(members)
        if not reference.shape or reference.shape[0] % size:
            dim0 = reference.shape[0] if reference.shape else "a 0-dim tensor"
            return OpError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{kind} of {name!r} needs dim 0 divisible by the group size {size}; "
                f"got {dim0} (shape {list(reference.shape)})",
            )
    return Plan(reference.dtype, reference.shape)
