"""Bounded recent-window summaries: an event rate and latency percentiles.

Both are fixed-size and cost a few list operations per event, so they can sit
on the op path (under the stats lock): :class:`WindowedRate` counts events in
two adjacent time buckets and reads the rate over the last ``window_s``
seconds as a sliding estimate; :class:`LatencyWindow` keeps the last
``size`` latencies in a ring and reads nearest-rank percentiles from them (the
last known latencies, however long ago the ops ran).
"""

from __future__ import annotations

import math

__all__ = ["LATENCY_SAMPLES", "RATE_WINDOW_S", "LatencyWindow", "WindowedRate"]

# The rates are over about this many recent seconds.
RATE_WINDOW_S = 10.0
# The percentiles are over this many most recent ops of a kind.
LATENCY_SAMPLES = 512


class WindowedRate:
    """Events per second over about the last ``window_s`` seconds.

    Time is split into buckets of ``window_s``; the rate is the current
    bucket's count plus the previous bucket's share that still lies in the
    window, over the window (over the time since the first event while that is
    shorter, at least one second), so a burst reads at once and an idle source
    decays to zero within two windows.
    """

    __slots__ = ("_bucket_s", "_current", "_first_s", "_previous", "window_s")

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._first_s: float | None = None
        self._bucket_s = 0.0
        self._current = 0
        self._previous = 0

    def _advance(self, now_s: float) -> None:
        if now_s - self._bucket_s < self.window_s:
            return
        passed = math.floor((now_s - self._bucket_s) / self.window_s)
        self._previous = self._current if passed == 1 else 0
        self._current = 0
        self._bucket_s += passed * self.window_s

    def add(self, now_s: float, n: int = 1) -> None:
        if self._first_s is None:
            self._first_s = self._bucket_s = now_s
        self._advance(now_s)
        self._current += n

    def rate(self, now_s: float) -> float:
        if self._first_s is None:
            return 0.0
        self._advance(now_s)
        into = min(max(now_s - self._bucket_s, 0.0) / self.window_s, 1.0)
        events = self._current + self._previous * (1.0 - into)
        span = min(self.window_s, max(now_s - self._first_s, 1.0))
        return events / span


class LatencyWindow:
    """The last ``size`` latencies (seconds) in a ring; percentiles by nearest rank."""

    __slots__ = ("_count", "_next", "_values")

    def __init__(self, size: int = LATENCY_SAMPLES) -> None:
        self._values = [0.0] * size
        self._next = 0
        self._count = 0

    def add(self, latency_s: float) -> None:
        self._values[self._next] = latency_s
        self._next = (self._next + 1) % len(self._values)
        self._count = min(self._count + 1, len(self._values))

    def __len__(self) -> int:
        return self._count

    def percentiles(self, *ps: float) -> tuple[float, ...]:
        """The ``ps`` percentiles (0-100) of the kept latencies; zeros when none."""
        if not self._count:
            return tuple(0.0 for _ in ps)
        ordered = sorted(self._values[: self._count])
        n = len(ordered)
        return tuple(ordered[min(n, max(1, math.ceil(p / 100 * n))) - 1] for p in ps)
