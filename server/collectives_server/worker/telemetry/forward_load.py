"""The forwards a worker is running or queueing now, and the routed ones it served.

A client places a small request (a forward too small to split across the
workers) on one worker by load (``collectives.models.placement``): each
``ForwardResponse`` says how many other forwards this worker had in flight when
it ended (``forwards_in_flight``), and the metrics count the forwards clients
placed here (``collectives_routed_forwards_total``, by model).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ForwardLoad"]


class ForwardLoad:
    """Forwards in flight on this worker, and routed forwards served, by model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._routed: Counter[str] = Counter()

    @contextmanager
    def running(self, model: str, routed: bool) -> Iterator[ForwardLoad]:
        """Counts one forward of ``model`` in flight while the block runs."""
        with self._lock:
            self._in_flight += 1
            if routed:
                self._routed[model] += 1
        try:
            yield self
        finally:
            with self._lock:
                self._in_flight -= 1

    @property
    def in_flight(self) -> int:
        """Forwards running or queued on this worker now."""
        with self._lock:
            return self._in_flight

    def routed(self) -> dict[str, int]:
        """Forwards clients placed on this worker by load, by model, since it started."""
        with self._lock:
            return dict(self._routed)
