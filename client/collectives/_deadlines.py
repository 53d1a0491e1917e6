"""Time left before a call's deadline: the one place that says "no time left".

Every wait the SDK makes (a gRPC call, a socket, shared memory, a thread, a
retry's backoff) takes its time from here, so a deadline that runs out anywhere
ends the call with ``DeadlineExceeded``, never with a ``ValueError`` from a
socket or a negative timeout handed to a library.
"""

from __future__ import annotations

import time

from collectives.errors import DeadlineExceeded

__all__ = ["time_left", "timeout_left"]


def time_left(deadline: float, what: str) -> float:
    """Seconds left before ``deadline`` (on ``time.monotonic()``).

    Raises:
        DeadlineExceeded: none are left (at or below zero).
    """
    return timeout_left(deadline - time.monotonic(), what)


def timeout_left(timeout: float, what: str) -> float:
    """``timeout`` (seconds left) when positive.

    Raises:
        DeadlineExceeded: it is at or below zero.
    """
    if timeout <= 0:
        raise DeadlineExceeded(f"{what}: the call's deadline passed before it could go on")
    return timeout
