"""The cross-rank verdict: pure, so every case is checked without a cluster."""

from __future__ import annotations

import grpc
import pytest
import torch

from collectives.reduce_ops import ReduceOp
from collectives.wire.op_specs import spec_named
from collectives_server.worker.engine.validation import (
    NOT_MEMBER,
    OperandInfo,
    OpError,
    Plan,
    decide,
    decode_info,
    encode_info,
)


def present(dtype=torch.float32, shape=(4, 3)) -> OperandInfo:
    return OperandInfo(1, dtype, tuple(shape))


ABSENT = OperandInfo(0)


@pytest.mark.parametrize(
    "t",
    [torch.randn(2, 3), torch.tensor(1.5), torch.empty(0, 5), torch.randint(0, 9, (1,) * 20)],
)
def test_info_round_trip(t: torch.Tensor) -> None:
    info = decode_info(encode_info(t, member=True))
    assert (info.dtype, info.shape) == (t.dtype, tuple(t.shape))


def test_info_of_non_member_and_absent() -> None:
    assert decode_info(encode_info(None, member=False)).state == NOT_MEMBER
    assert decode_info(encode_info(None, member=True)) == ABSENT


def test_agreeing_operands_give_a_plan() -> None:
    plan = decide(spec_named("all_reduce"), "x", [0, 1, 2], [present()] * 3)
    assert plan == Plan(torch.float32, (4, 3))


def test_absent_everywhere_is_not_found() -> None:
    verdict = decide(spec_named("all_reduce"), "x", [0, 1], [ABSENT, ABSENT])
    assert isinstance(verdict, OpError) and verdict.code == grpc.StatusCode.NOT_FOUND
    assert "'x'" in verdict.message


def test_absent_on_some_ranks_names_them() -> None:
    verdict = decide(spec_named("all_gather"), "x", [0, 1, 2], [present(), ABSENT, present()])
    assert isinstance(verdict, OpError)
    assert verdict.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "rank(s) 1" in verdict.message


def test_shape_mismatch_names_every_rank() -> None:
    verdict = decide(
        spec_named("all_reduce"), "g", [0, 1], [present(shape=(2,)), present(shape=(3,))]
    )
    assert isinstance(verdict, OpError)
    assert verdict.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "rank 0: float32[2]" in verdict.message and "rank 1: float32[3]" in verdict.message


def test_broadcast_needs_only_src() -> None:
    infos = [ABSENT, present(torch.int64, (5,)), ABSENT]
    assert decide(spec_named("broadcast"), "x", [0, 1, 2], infos, root=1) == Plan(torch.int64, (5,))
    verdict = decide(spec_named("broadcast"), "x", [0, 1, 2], infos, root=0)
    assert isinstance(verdict, OpError)
    assert verdict.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "src rank 0" in verdict.message
    verdict = decide(spec_named("broadcast"), "x", [0, 1, 2], [ABSENT] * 3, root=0)
    assert isinstance(verdict, OpError) and verdict.code == grpc.StatusCode.NOT_FOUND


def test_non_members_are_ignored() -> None:
    infos = [present(), OperandInfo(NOT_MEMBER), present()]
    assert isinstance(decide(spec_named("all_reduce"), "x", [0, 2], infos), Plan)


@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
def test_bitwise_on_float_is_invalid(op: ReduceOp) -> None:
    verdict = decide(spec_named("all_reduce"), "x", [0, 1], [present()] * 2, op=op)
    assert isinstance(verdict, OpError) and verdict.code == grpc.StatusCode.INVALID_ARGUMENT


def test_avg_on_integers_is_invalid() -> None:
    verdict = decide(spec_named("reduce"), "x", [0, 1], [present(torch.int64)] * 2, op=ReduceOp.AVG)
    assert isinstance(verdict, OpError) and verdict.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_to_all"])
def test_dim0_must_divide(kind: str) -> None:
    verdict = decide(spec_named(kind), "x", [0, 1, 2], [present(shape=(4, 2))] * 3)
    assert isinstance(verdict, OpError) and verdict.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "divisible" in verdict.message
    assert isinstance(decide(spec_named(kind), "x", [0, 1], [present(shape=(4, 2))] * 2), Plan)


def test_barrier_needs_no_operand() -> None:
    assert isinstance(decide(spec_named("barrier"), "", [0, 1], [ABSENT, ABSENT]), Plan)
