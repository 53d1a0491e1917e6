"""Dynamic batching of forwards: the policy a model is loaded with, as it travels.

``Batching(max_rows, max_delay_ms)`` asks each worker to merge concurrent
forwards of one model and version, from any clients, into one forward of up to
``max_rows`` rows, waiting at most ``max_delay_ms`` for company; the outputs are
split back to their callers row for row. Only forwards without autograd of a
model in eval mode are merged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from collectives.errors import InvalidArgument
from collectives.v1 import worker_pb2

__all__ = ["Batching", "MAX_ROWS_LIMIT", "MAX_DELAY_MS_LIMIT"]

# The bounds a policy is checked against: a batch larger than this is a memory
# hazard on the worker, a delay longer than this a latency one.
MAX_ROWS_LIMIT = 1 << 20
MAX_DELAY_MS_LIMIT = 10_000.0


@dataclass(frozen=True)
class Batching:
    """Merge concurrent forwards of a model into one forward on each worker.

    Only for models whose every output row depends on its own input row alone
    (per-row layers in eval mode): a model that mixes rows across dim 0 would
    give each caller rows computed with other callers' rows, undetectably.

    Args:
        max_rows: the most rows (dim 0 of the inputs) one merged forward runs;
            a caller with more rows runs alone. Defaults to 256.
        max_delay_ms: how long the first caller waits for company before the
            merged forward starts; 0 merges only what is already waiting and
            never waits. Defaults to 0.

    Raises:
        InvalidArgument: ``max_rows`` is not a positive integer or
            ``max_delay_ms`` is negative, not finite, or too large.
    """

    max_rows: int = 256
    max_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int):
            raise InvalidArgument(f"Batching max_rows must be an int, got {self.max_rows!r}")
        if not 1 <= self.max_rows <= MAX_ROWS_LIMIT:
            raise InvalidArgument(
                f"Batching max_rows must be in 1..{MAX_ROWS_LIMIT}, got {self.max_rows}"
            )
        delay = self.max_delay_ms
        if isinstance(delay, bool) or not isinstance(delay, int | float):
            raise InvalidArgument(f"Batching max_delay_ms must be a number, got {delay!r}")
        if not math.isfinite(delay) or not 0 <= delay <= MAX_DELAY_MS_LIMIT:
            raise InvalidArgument(
                f"Batching max_delay_ms must be in 0..{MAX_DELAY_MS_LIMIT:g}, got {delay}"
            )
        object.__setattr__(self, "max_delay_ms", float(delay))

    def to_proto(self) -> worker_pb2.ForwardBatching:
        return worker_pb2.ForwardBatching(max_rows=self.max_rows, max_delay_ms=self.max_delay_ms)

    @classmethod
    def from_proto(cls, msg: worker_pb2.ForwardBatching) -> Batching:
        """The policy a message carries.

        Raises:
            InvalidArgument: it is out of bounds.
        """
        return cls(max_rows=int(msg.max_rows), max_delay_ms=float(msg.max_delay_ms))

    @classmethod
    def parse(cls, text: str) -> Batching:
        """``"256"`` or ``"256:2.0"`` (max_rows, then max_delay_ms), as a flag spells it.

        Raises:
            InvalidArgument: not of that form, or out of bounds.
        """
        rows, _, delay = text.strip().partition(":")
        try:
            max_rows, max_delay_ms = int(rows), float(delay) if delay else 0.0
        except ValueError:
            raise InvalidArgument(
                f"batching {text!r}: use MAX_ROWS or MAX_ROWS:MAX_DELAY_MS (e.g. 256:2)"
            ) from None
        return cls(max_rows=max_rows, max_delay_ms=max_delay_ms)
