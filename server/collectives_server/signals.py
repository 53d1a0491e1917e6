"""Waiting for SIGTERM/SIGINT (or a nudge from another thread) without deadlocks.

A daemon's main thread sleeps until it is told to stop. The obvious tool,
``threading.Event.set()`` inside a signal handler, can deadlock: Python runs the
handler in the main thread between bytecodes, possibly while that thread holds the
Event's internal lock. :class:`StopSignal` avoids every lock: the handler only
stores the signal number, and ``signal.set_wakeup_fd`` makes the interpreter write
a byte into a pipe that :meth:`StopSignal.wait` selects on. Other threads wake the
waiter the same way (:meth:`StopSignal.wake`), e.g. when a child process exits.

Used by ``collectives-server coordinator`` and ``local``; the worker daemon can
use it too. POSIX only, main thread only (a limit of ``signal.signal``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from types import FrameType, TracebackType

__all__ = ["StopSignal"]


class StopSignal:
    """Context manager: installs SIGTERM/SIGINT handlers, restores the old ones on exit."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)):
        self._signals = signals
        self.received: int | None = None  # the first stop signal, once one arrived
        self._old: dict[signal.Signals, object] = {}
        self._old_wakeup_fd = -1
        self._r = self._w = -1

    def __enter__(self) -> StopSignal:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        for sig in self._signals:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_wakeup_fd)
        os.close(self._r)
        os.close(self._w)
        self._r = self._w = -1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # No locks here: a plain store. The wakeup fd already woke the waiter.
        if self.received is None:
            self.received = signum

    @property
    def stopping(self) -> bool:
        return self.received is not None

    def wake(self) -> None:
        """Wakes :meth:`wait` from any thread (or a signal handler)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._w, b"\0")

    def wait(self, timeout_s: float | None) -> bool:
        """Blocks until a stop signal, a :meth:`wake`, or ``timeout_s``; returns ``stopping``."""
        if self.received is None:
            readable, _, _ = select.select([self._r], [], [], timeout_s)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._r, 512):
                        pass
        return self.stopping
