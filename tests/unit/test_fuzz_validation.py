"""Property tests of the request validators (hypothesis).

Whatever a client sends, the validators answer with ``collectives.InvalidArgument``
(a clean INVALID_ARGUMENT status) and never with anything else, and the
cross-rank ``validation.decide`` always returns a Plan or an OpError.
"""

from __future__ import annotations

import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives import InvalidArgument, ReduceOp
from collectives.reduce_ops import parse_reduce_op
from collectives.wire.dtypes import SUPPORTED_DTYPES, from_wire, to_wire
from collectives.wire.names import MAX_NAME_LENGTH, validate_name
from collectives.wire.op_specs import SPECS
from collectives_server.worker.engine import validation
from collectives_server.worker.engine.validation import (
    ABSENT,
    INFO_LEN,
    NOT_MEMBER,
    PRESENT,
    OperandInfo,
    OpError,
    Plan,
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=300),
    st.binary(max_size=64),
    st.lists(st.integers(), max_size=3),
    st.sampled_from(list(ReduceOp)),
    st.sampled_from(list(SUPPORTED_DTYPES)),
)
int64s = st.integers(-(1 << 63), (1 << 63) - 1)


@FUZZ
@given(name=st.one_of(anything, st.text(min_size=250, max_size=270)))
def test_validate_name_raises_only_invalid_argument(name) -> None:
    try:
        assert validate_name(name) == name
    except InvalidArgument as exc:
        assert "name" in exc.message
        return
    assert isinstance(name, str) and 1 <= len(name) <= MAX_NAME_LENGTH


@FUZZ
@given(op=anything)
def test_parse_reduce_op_raises_only_invalid_argument(op) -> None:
    try:
        assert isinstance(parse_reduce_op(op), ReduceOp)
    except InvalidArgument as exc:
        assert "reduce op" in exc.message


@FUZZ
@given(value=st.one_of(int64s, st.integers(-20, 20)))
def test_reduce_op_from_wire_raises_only_invalid_argument(value: int) -> None:
    try:
        op = ReduceOp.from_wire(value)
    except InvalidArgument as exc:
        assert str(value) in exc.message
        return
    assert value == 0 or op.wire == value


@FUZZ
@given(value=st.one_of(int64s, st.integers(-20, 20)))
def test_dtype_from_wire_raises_only_invalid_argument(value: int) -> None:
    try:
        dtype = from_wire(value)
    except InvalidArgument as exc:
        assert str(value) in exc.message
        return
    assert to_wire(dtype) == value


@st.composite
def operand_infos(draw) -> OperandInfo:
    state = draw(st.sampled_from([ABSENT, PRESENT, NOT_MEMBER, 3, -1]))
    if state != PRESENT:
        return OperandInfo(state)
    dtype = draw(st.sampled_from(SUPPORTED_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=4)))
    return OperandInfo(PRESENT, dtype, shape)


@FUZZ
@given(data=st.data(), size=st.integers(1, 5))
def test_decide_never_raises(data, size: int) -> None:
    infos = data.draw(st.lists(operand_infos(), min_size=size, max_size=size))
    # Shared operands are likely to agree, so the deeper checks are reached too.
    if data.draw(st.booleans()):
        infos = [infos[0]] * size
    members = sorted(data.draw(st.sets(st.integers(0, size - 1), min_size=1)))
    kind = data.draw(st.sampled_from([s for s in SPECS.values() if s.is_collective]))
    root = data.draw(st.sampled_from(members))
    op = data.draw(st.sampled_from(list(ReduceOp)))
    verdict = validation.decide(kind, "fuzz/x", members, infos, root, op)
    assert isinstance(verdict, Plan | OpError)
    if isinstance(verdict, OpError):
        assert verdict.code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert "fuzz/x" in verdict.message


@FUZZ
@given(values=st.lists(int64s, min_size=INFO_LEN, max_size=INFO_LEN))
def test_decode_info_of_garbage_raises_only_invalid_argument(values: list[int]) -> None:
    """A peer's operand vector is trusted, but garbage still fails cleanly."""
    try:
        info = validation.decode_info(torch.tensor(values, dtype=torch.int64))
    except InvalidArgument:
        return
    assert isinstance(info, OperandInfo)


@FUZZ
@given(
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    shape=st.lists(st.integers(0, 4), max_size=5),
    member=st.booleans(),
)
def test_encode_decode_info_round_trip(dtype, shape, member: bool) -> None:
    t = torch.zeros(shape, dtype=dtype)
    info = validation.decode_info(validation.encode_info(t, member))
    if member:
        assert info == OperandInfo(PRESENT, dtype, tuple(shape))
    else:
        assert info.state == NOT_MEMBER
