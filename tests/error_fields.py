"""What every error a caller sees must say about itself: its structured fields.

The integration and fault suites record every :class:`CollectiveError` made in
the test process while a test runs (``recording_errors``) and, when the test
ends, check each one with :func:`field_problems`: an error whose message names
the ranks at fault carries them in ``ranks``; an op refused before it started
says ``executed=False``; an error about one op names its generation and kind.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from collectives.errors import NEVER_STARTED, CollectiveError, Reason

__all__ = ["field_problems", "recording_errors"]

# Wordings that name the ranks an error is about: "rank(s) 1, 2", "(ranks 0, 1)",
# "src rank (1)".
_RANK_LIST = re.compile(
    r"\brank\(s\) (\d+(?:, \d+)*)|\(ranks (\d+(?:, \d+)*)\)|\branks? \((\d+(?:, \d+)*)\)"
)
# Reasons that concern particular ranks, which the error must then name.
_ABOUT_RANKS = {Reason.OPERAND_MISSING, Reason.OPERAND_MISMATCH, Reason.QUOTA}


def field_problems(err: CollectiveError) -> list[str]:
    """What ``err``'s structured fields fail to say; empty when they are complete."""
    problems = []
    named = {
        int(r)
        for match in _RANK_LIST.finditer(err.message)
        for g in match.groups()
        if g
        for r in g.split(", ")
    }
    if named and not err.ranks:
        problems.append(f"the message names rank(s) {sorted(named)} but ranks is empty")
    if err.reason in _ABOUT_RANKS and not err.ranks:
        problems.append(f"reason {err.reason} concerns ranks but ranks is empty")
    if err.reason in NEVER_STARTED and err.executed is not False:
        problems.append(f"reason {err.reason} means it never started, executed={err.executed}")
    if err.op_id is not None and (err.generation is None or not err.kind):
        problems.append("an op's error without its generation or kind")
    return problems


@contextmanager
def recording_errors() -> Iterator[list[CollectiveError]]:
    """Every CollectiveError constructed in this process inside the block, in order."""
    made: list[CollectiveError] = []
    construct = CollectiveError.__init__

    def recording(self: CollectiveError, *args: object, **kwargs: object) -> None:
        construct(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    CollectiveError.__init__ = recording  # type: ignore[method-assign]
    try:
        yield made
    finally:
        CollectiveError.__init__ = construct  # type: ignore[method-assign]
