"""Progress bars for long transfers: puts, gets and model loads of 256 MiB or more.

A bar (``tqdm``, imported only when one is shown) goes to stderr when the
transfer holds at least :data:`PROGRESS_MIN_BYTES`, and either stderr is a
terminal (the default) or bars are forced on. ``connect(progress=False)`` or
``COLLECTIVES_PROGRESS=0`` turns them off; ``progress=True`` or
``COLLECTIVES_PROGRESS=1`` shows them even without a terminal (a notebook, a
log file). Without a bar, :func:`progress` returns :data:`NO_PROGRESS`, whose
``advance`` does nothing: the data path pays one no-op call per chunk.

One bar may be advanced from several threads at once (a put to several ranks
runs one upload per thread): updates take a lock, and tqdm redraws at most
every :data:`REDRAW_S` seconds.
"""

from __future__ import annotations

import os
import sys
import threading
from types import TracebackType
from typing import IO, Any

__all__ = [
    "NO_PROGRESS",
    "Deferred",
    "PROGRESS_ENV",
    "PROGRESS_MIN_BYTES",
    "Progress",
    "progress",
    "setting",
]

# Transfers smaller than this never show a bar.
PROGRESS_MIN_BYTES = 256 << 20
# Environment fallback of connect(progress=...): "0" turns bars off, "1" forces them on.
PROGRESS_ENV = "COLLECTIVES_PROGRESS"
# tqdm's mininterval: the bar is redrawn at most this often.
REDRAW_S = 0.25

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def setting(progress: bool | None) -> bool | None:
    """``connect``'s ``progress`` argument, or its environment fallback when None.

    True: bars even without a terminal; False: no bars; None: bars on a terminal.
    """
    if progress is not None:
        return bool(progress)
    value = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    return None


class Progress:
    """No bar: every method does nothing (see :data:`NO_PROGRESS`)."""

    __slots__ = ()

    def advance(self, n: int) -> None:
        """Counts ``n`` more bytes moved (negative: an attempt's bytes taken back)."""

    def attempt(self) -> Progress:
        """A context for one try of a transfer: on an error its bytes are taken back."""
        return self

    def close(self) -> None:
        """Ends the bar (left on screen)."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


NO_PROGRESS = Progress()


class _Bar(Progress):
    """A tqdm bar in bytes, safe to advance from several threads."""

    __slots__ = ("_bar", "_lock")

    def __init__(self, what: str, total_bytes: int, file: IO[str]) -> None:
        from tqdm import tqdm  # only here: no bar, no import

        self._lock = threading.Lock()
        self._bar: Any = tqdm(
            total=total_bytes,
            desc=what,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=file,
            mininterval=REDRAW_S,
            dynamic_ncols=True,
            leave=True,
        )

    def advance(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def attempt(self) -> Progress:
        return _Attempt(self)

    def close(self) -> None:
        with self._lock:
            self._bar.close()


class _Attempt(Progress):
    """Counts one try's bytes into its bar; takes them back if the try fails."""

    __slots__ = ("_bar", "_done")

    def __init__(self, bar: _Bar) -> None:
        self._bar = bar
        self._done = 0

    def advance(self, n: int) -> None:
        self._done += n
        self._bar.advance(n)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None and self._done:
            self._bar.advance(-self._done)  # a retry or another path sends them again
        self._done = 0


def progress(
    what: str, total_bytes: int, enabled: bool | None = None, *, file: IO[str] | None = None
) -> Progress:
    """A bar for a transfer of ``total_bytes``, or :data:`NO_PROGRESS`.

    ``enabled`` is a :func:`setting`: False never shows one, True shows one
    whatever ``file`` (default: ``sys.stderr`` now) is, None only on a terminal.
    Transfers below :data:`PROGRESS_MIN_BYTES` never show one.
    """
    if enabled is False or total_bytes < PROGRESS_MIN_BYTES:
        return NO_PROGRESS
    if file is None:
        file = sys.stderr
        if file is None:
            return NO_PROGRESS
    if enabled is None:
        try:
            if not file.isatty():
                return NO_PROGRESS
        except (AttributeError, ValueError, OSError):
            return NO_PROGRESS
    return _Bar(what, total_bytes, file)


class Deferred:
    """A bar for a transfer whose size is known only once it starts (a get).

    :meth:`start` (called with the size, at most once per try) gives the bar to
    advance; the context closes whichever bar was started.
    """

    __slots__ = ("_bar", "_enabled", "_file", "_what")

    def __init__(self, what: str, enabled: bool | None, file: IO[str] | None = None) -> None:
        self._what = what
        self._enabled = enabled
        self._file = file
        self._bar: Progress = NO_PROGRESS

    def start(self, total_bytes: int) -> Progress:
        self._bar.close()  # a retry's fresh start replaces the failed try's bar
        self._bar = progress(self._what, total_bytes, self._enabled, file=self._file)
        return self._bar

    def __enter__(self) -> Deferred:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bar.close()
        self._bar = NO_PROGRESS
