"""The cross-rank verdict of an uneven all_to_all: pure, identical on every rank.

The ``split_sizes`` matrix (``split_sizes[i][j]`` rows of dim 0 from member i
to member j, group-local indices) travels in the descriptor; every rank's
operand description and quota state come from the operand exchange
(``validation.info_values``). From the same inputs every rank reaches the same
verdict, in this order:

* the matrix is a square of the group's size of non-negative ints
  (``op_args.check_split_matrix``, the SDK's and the servicer's own check);
* the operand is on every member (``validation``'s wording: NOT_FOUND when on
  none, FAILED_PRECONDITION naming the ranks that lack it);
* no member's operand is 0-dim (INVALID_ARGUMENT naming the ranks);
* every member's operand has the same dtype and the same dims after dim 0
  (FAILED_PRECONDITION, operands disagree; dim 0 may differ);
* row i sums to dim 0 of member i's operand (INVALID_ARGUMENT naming the rank,
  its dim 0 and the row sum);
* member j's result, ``(column j's sum, *dims after 0)``, is a sane shape and
  fits its store (RESOURCE_EXHAUSTED, as for the other collectives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from collectives.errors import InvalidArgument, Reason
from collectives.wire.codec import check_shape
from collectives.wire.op_args import check_split_matrix, split_rows
from collectives.wire.op_specs import OpSpec
from collectives_server.worker.data.store import quota_message
from collectives_server.worker.engine.validation import PRESENT, OperandInfo, OpError, _missing

__all__ = ["UnevenPlan", "decide_uneven"]


@dataclass(frozen=True)
class UnevenPlan:
    """What the op will do: the common dtype and dims after 0, and the row matrix."""

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    matrix: tuple[tuple[int, ...], ...]  # [i][j]: rows from member i to member j

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.row_shape:
            n *= d
        return n

    def recv_rows(self, index: int) -> list[int]:
        return [row[index] for row in self.matrix]

    def result_shape(self, index: int) -> tuple[int, ...]:
        """Member ``index``'s result: the rows every member sends it, in member order."""
        return (sum(self.recv_rows(index)), *self.row_shape)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def decide_uneven(
    spec: OpSpec,
    name: str,
    members: list[int],
    infos: list[OperandInfo],
    split_sizes: Sequence[int],
    target: str = "",
) -> UnevenPlan | OpError:
    """The verdict for ``split_sizes`` (row-major, as on the wire) over ``members``
    (global ranks, ascending); ``infos`` is indexed by global rank."""
    size = len(members)
    try:
        matrix = check_split_matrix(split_rows(split_sizes, size), size)
    except InvalidArgument as exc:
        return OpError(grpc.StatusCode.INVALID_ARGUMENT, f"{spec.name} of {name!r}: {exc.message}")
    missing = [r for r in members if infos[r].state != PRESENT]
    if missing:
        return _missing(spec, name, members, members, missing, infos, 0)
    error = _check_operands(spec, name, members, infos, matrix)
    if error is not None:
        return error
    reference = infos[members[0]]
    assert reference.dtype is not None
    plan = UnevenPlan(reference.dtype, reference.shape[1:], tuple(tuple(r) for r in matrix))
    try:
        for j in range(size):
            check_shape(plan.result_shape(j))
    except InvalidArgument as exc:
        return OpError(grpc.StatusCode.INVALID_ARGUMENT, f"{spec.name} of {name!r}: {exc.message}")
    return _check_quota(target or name, members, infos, plan) or plan


def _check_operands(
    spec: OpSpec,
    name: str,
    members: list[int],
    infos: list[OperandInfo],
    matrix: list[list[int]],
) -> OpError | None:
    scalar = [r for r in members if not infos[r].shape]
    if scalar:
        return OpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{spec.name} of {name!r}: the tensor is 0-dim on rank(s) {_ranks(scalar)}; "
            "split_sizes split dim 0, so every member needs at least one dim",
            ranks=tuple(scalar),
        )
    reference = infos[members[0]]
    differing = [
        r
        for r in members
        if (infos[r].dtype, infos[r].shape[1:]) != (reference.dtype, reference.shape[1:])
    ]
    if differing:
        described = "; ".join(f"rank {r}: {infos[r].describe()}" for r in members)
        return OpError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"tensor {name!r} disagrees across ranks ({described}); {spec.name} needs the "
            "same dtype and the same dims after dim 0 on every rank",
            reason=Reason.OPERAND_MISMATCH,
            ranks=tuple(differing),
        )
    wrong = [
        (r, infos[r].shape[0], sum(row))
        for r, row in zip(members, matrix, strict=True)
        if infos[r].shape[0] != sum(row)
    ]
    if wrong:
        words = "; ".join(
            f"rank {r} (member {members.index(r)}) has {dim0} rows in dim 0 but its row of "
            f"split_sizes sums to {total}"
            for r, dim0, total in wrong
        )
        return OpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{spec.name} of {name!r}: {words}; row i of split_sizes must sum to dim 0 of "
            "member i's tensor",
            ranks=tuple(r for r, _, _ in wrong),
        )
    return None


def _check_quota(
    target: str, members: list[int], infos: list[OperandInfo], plan: UnevenPlan
) -> OpError | None:
    """Every member stores its own result (column sum x row bytes); judged as
    ``validation`` judges the even collectives, from the exchanged quota states."""
    over = []
    for j, r in enumerate(members):
        info = infos[r]
        incoming = sum(plan.recv_rows(j)) * plan.row_bytes
        if info.limit >= 0 and incoming and info.held + incoming > info.limit:
            over.append((r, quota_message(target, incoming, info.held + incoming, info.limit)))
    if not over:
        return None
    return OpError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"failed on rank(s) {_ranks([r for r, _ in over])}: {over[0][1]}",
        reason=Reason.QUOTA,
        ranks=tuple(r for r, _ in over),
    )
