"""Cross-rank operand validation: pure decisions, no I/O.

Before any data is used, every rank contributes a small int64 vector describing
its operand (present?, dtype, shape) and its store's quota state (bytes held
apart from the op's target, and the limit); the vectors are all-gathered and
every rank calls :func:`decide` on the same inputs, so every rank reaches the
same verdict and fails (or proceeds) together with one message. torch.distributed
does not check shapes across ranks and silently returns garbage; we refuse.

Because every rank's quota state is in the exchange, a result that would not
fit in some rank's store is refused by every rank *before* the data
collective, with no extra round, and the commit after it never fails for quota.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from collectives.errors import InvalidArgument, Reason
from collectives.reduce_ops import ReduceOp, check_op_for_dtype
from collectives.wire.codec import check_shape
from collectives.wire.dtypes import from_wire, to_wire
from collectives.wire.op_specs import Operand, OpSpec, check_dim0_divisible
from collectives_server.worker.data.store import quota_message

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
]

ABSENT, PRESENT, NOT_MEMBER = 0, 1, 2
MAX_DIMS = 64
# state, dtype, ndim, bytes held apart from the target, store limit (-1: none),
# reserved, then the dims. 70 int64 = 560 bytes, a multiple of 16, so payload
# bytes that follow an info vector stay aligned for every dtype.
_HEADER = 6
INFO_LEN = _HEADER + MAX_DIMS
INFO_BYTES = INFO_LEN * 8


@dataclass(frozen=True)
class OperandInfo:
    state: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    held: int = 0  # bytes in the rank's store apart from the op's target
    limit: int = -1  # the rank's store limit; -1: none

    @property
    def nbytes(self) -> int:
        if self.state != PRESENT or self.dtype is None:
            return 0
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        if self.state != PRESENT or self.dtype is None:
            return "absent"
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True)
class OpError:
    code: grpc.StatusCode
    message: str
    reason: str | None = None  # collectives.errors.Reason
    ranks: tuple[int, ...] = ()  # the ranks at fault, when some are


@dataclass(frozen=True)
class Plan:
    """What the op will do: the operand's dtype and shape (for broadcast: src's)."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]


def info_values(
    t: torch.Tensor | None, member: bool, quota: tuple[int, int] = (0, -1)
) -> list[int]:
    """The INFO_LEN integers describing this rank's operand and quota state."""
    v = [0] * INFO_LEN
    v[3], v[4] = quota
    if not member:
        v[0] = NOT_MEMBER
    elif t is not None:
        if t.dim() > MAX_DIMS:  # the codec refuses these at put time; defensive
            raise InvalidArgument(f"tensor has {t.dim()} dims; at most {MAX_DIMS} supported")
        v[0] = PRESENT
        v[1] = to_wire(t.dtype)
        v[2] = t.dim()
        v[_HEADER : _HEADER + t.dim()] = t.shape
    return v


def encode_info(
    t: torch.Tensor | None, member: bool, quota: tuple[int, int] = (0, -1)
) -> torch.Tensor:
    return torch.tensor(info_values(t, member, quota), dtype=torch.int64, device="cpu")


def decode_info(v: torch.Tensor | list[int]) -> OperandInfo:
    values = v if isinstance(v, list) else v.tolist()
    state = int(values[0])
    held, limit = int(values[3]), int(values[4])
    if state != PRESENT:
        return OperandInfo(state, held=held, limit=limit)
    ndim = int(values[2])
    return OperandInfo(
        PRESENT,
        from_wire(int(values[1])),
        tuple(int(d) for d in values[_HEADER : _HEADER + ndim]),
        held,
        limit,
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def decide(
    spec: OpSpec,
    name: str,
    members: list[int],
    infos: list[OperandInfo],
    root: int = 0,
    op: ReduceOp = ReduceOp.SUM,
    target: str = "",
) -> Plan | OpError:
    """The verdict every rank reaches for one op of kind ``spec``.

    ``members`` are the group's global ranks in ascending order; ``infos`` is
    indexed by global rank (non-members included, ignored). ``target`` is the
    name the result is stored under (default: ``name``), for quota messages.
    """
    if spec.operand is Operand.NONE:
        return Plan(None, ())
    required = spec.contributors(members, root)
    missing = [r for r in required if infos[r].state != PRESENT]
    if missing:
        return _missing(spec, name, members, required, missing, infos, root)
    reference = infos[required[0]]
    if spec.operand is Operand.MEMBERS:
        differing = [
            r
            for r in required
            if (infos[r].dtype, infos[r].shape) != (reference.dtype, reference.shape)
        ]
        if differing:
            described = "; ".join(f"rank {r}: {infos[r].describe()}" for r in required)
            return OpError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tensor {name!r} disagrees across ranks ({described}); {spec.name} needs the "
                "same dtype and shape on every rank",
                reason=Reason.OPERAND_MISMATCH,
                ranks=tuple(differing),
            )
    assert reference.dtype is not None
    try:
        check_shape(spec.result_shape(reference.shape, len(members)))
        if spec.reducing:
            check_op_for_dtype(op, reference.dtype)
        check_dim0_divisible(spec, name, reference.shape, len(members))
    except InvalidArgument as exc:
        # Also for a tensor that reached the store some other way (a factory, a model
        # output) with absurd dims: every rank fails alike before data moves.
        return OpError(grpc.StatusCode.INVALID_ARGUMENT, f"{spec.name} of {name!r}: {exc.message}")
    plan = Plan(reference.dtype, reference.shape)
    return _check_quota(spec, target or name, members, infos, root, plan) or plan


def _missing(
    spec: OpSpec,
    name: str,
    members: list[int],
    required: list[int],
    missing: list[int],
    infos: list[OperandInfo],
    root: int,
) -> OpError:
    if spec.operand is Operand.ROOT:
        holders = [r for r in members if infos[r].state == PRESENT]
        if not holders:
            return OpError(
                grpc.StatusCode.NOT_FOUND,
                f"tensor {name!r} not found on any rank of the group (ranks "
                f"{_ranks(members)}); put it on {spec.root_role} rank {root} before the "
                f"{spec.name}",
                reason=Reason.OPERAND_MISSING,
                ranks=tuple(members),
            )
        return OpError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"tensor {name!r} is missing on {spec.root_role} rank {root} (present on rank(s) "
            f"{_ranks(holders)}); {spec.name} needs it on the {spec.root_role} rank",
            reason=Reason.OPERAND_MISSING,
            ranks=(root,),
        )
    if len(missing) == len(required):
        return OpError(
            grpc.StatusCode.NOT_FOUND,
            f"tensor {name!r} not found on any rank of the group (ranks {_ranks(members)})",
            reason=Reason.OPERAND_MISSING,
            ranks=tuple(required),
        )
    return OpError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"tensor {name!r} is missing on rank(s) {_ranks(missing)} but present on "
        f"rank(s) {_ranks([r for r in required if r not in missing])}; {spec.name} needs it "
        "on every rank of the group",
        reason=Reason.OPERAND_MISSING,
        ranks=tuple(missing),
    )


def _check_quota(
    spec: OpSpec,
    target: str,
    members: list[int],
    infos: list[OperandInfo],
    root: int,
    plan: Plan,
) -> OpError | None:
    """Every rank judges every member's quota from the exchanged states, identically."""
    over = []
    for r in members:
        info = infos[r]
        if info.limit < 0:
            continue
        incoming = spec.result_nbytes(plan.dtype, plan.shape, len(members), r, root)
        if incoming and info.held + incoming > info.limit:
            over.append((r, quota_message(target, incoming, info.held + incoming, info.limit)))
    if not over:
        return None
    ranks = ", ".join(str(r) for r, _ in over)
    return OpError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"failed on rank(s) {ranks}: {over[0][1]}",
        reason=Reason.QUOTA,
        ranks=tuple(r for r, _ in over),
    )
