"""The check the integration and fault suites run on every error they provoke can fail."""

from __future__ import annotations

from error_fields import field_problems, recording_errors

from collectives.errors import FailedPrecondition, NotFound, Reason, error_for_code


def test_a_message_naming_ranks_needs_the_ranks_field() -> None:
    err = NotFound("tensor 'x' not found on any rank of the group (ranks 0, 1)")
    assert field_problems(err) == ["the message names rank(s) [0, 1] but ranks is empty"]
    assert field_problems(NotFound("... (ranks 0, 1)", ranks=(0, 1))) == []


def test_a_refusal_is_never_started_by_construction() -> None:
    err = FailedPrecondition("missing on rank(s) 1", reason=Reason.OPERAND_MISSING, ranks=(1,))
    assert err.executed is False and field_problems(err) == []
    forced = FailedPrecondition("m", reason=Reason.OPERAND_MISSING, ranks=(1,), executed=True)
    assert field_problems(forced) == [
        "reason OPERAND_MISSING means it never started, executed=True"
    ]


def test_an_ops_error_names_its_generation_and_kind() -> None:
    err = error_for_code(NotFound.default_code, "gone", op_id=3)
    assert field_problems(err) == ["an op's error without its generation or kind"]


def test_recording_sees_every_error_made_in_the_block() -> None:
    with recording_errors() as made:
        first = NotFound("a")
        second = FailedPrecondition("b")
    NotFound("after")
    assert made == [first, second]
