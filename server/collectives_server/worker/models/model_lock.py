"""A hosted model's lock: exclusive for whatever may change the model, shared by the
forwards that only read it.

Everything that changes a hosted model (a publish's commit, an optimizer step,
a mode switch, a forward with autograd or in training mode, a backward, the
weights sent to a rank catching up) holds the lock *exclusively*: ``with
model.lock:``, reentrant, as a ``threading.RLock``. Forwards without autograd
in eval mode read nothing but the weights and may run at once, as the threads of
any gRPC model server do: they hold it *shared*
(:func:`~collectives_server.worker.models.versions.serving` with
``shared=True``).

An exclusive holder waits for the shared holders to leave, and while one waits
no new shared holder is admitted, so a stream of forwards cannot starve a
publish. The version a forward runs at is fixed while it holds the lock either
way: a commit is exclusive.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["ModelLock"]


class ModelLock:
    """Exclusive (reentrant) or shared; see the module."""

    def __init__(self) -> None:
        self._mutex = threading.RLock()
        self._changed = threading.Condition(self._mutex)
        self._readers = 0  # shared holders running
        self._writers_waiting = 0  # exclusive holders waiting for the readers to leave
        self._sleepers = 0  # threads waiting on _changed (notified only when some wait)

    # -- exclusive ---------------------------------------------------------------

    def acquire(self, blocking: bool = True) -> bool:
        """Holds the lock exclusively (reentrant); without ``blocking``, only if nobody
        holds it at all."""
        if not self._mutex.acquire(blocking):
            return False
        if self._readers:
            if not blocking:
                self._mutex.release()
                return False
            self.drain()
        return True

    def release(self) -> None:
        if self._sleepers:
            self._changed.notify_all()
        self._mutex.release()

    def __enter__(self) -> ModelLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def wait(self, timeout: float, exclusive: bool = True) -> None:
        """The holder (exclusive, or admitted by :meth:`admitted`) lets go until
        :meth:`notify_all` or ``timeout`` seconds, then holds it as before."""
        self._sleep(timeout)
        if exclusive and self._readers:
            self.drain()

    def notify_all(self) -> None:
        """Wakes every :meth:`wait` (the caller holds the lock)."""
        if self._sleepers:
            self._changed.notify_all()

    # -- shared --------------------------------------------------------------------

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Holds the lock's mutex without waiting for the shared holders (but after any
        exclusive holder waiting for them): the block may read the model, :meth:`wait`
        with ``exclusive=False``, :meth:`drain` to change it, and :meth:`join` to hold
        the lock shared once the block ends."""
        with self._mutex:
            while self._writers_waiting:
                self._sleep(None)
            yield

    @property
    def exclusive_waiting(self) -> bool:
        """Whether an exclusive holder waits for shared ones to leave (new ones wait)."""
        return self._writers_waiting > 0

    def try_admit(self) -> bool:
        """Holds the lock's mutex if nobody holds it now (shared holders may run), for
        what shared holders never touch (a model's retained graphs); release with
        :meth:`release`. False, at once, while an exclusive holder or an admission has it."""
        return self._mutex.acquire(blocking=False)

    def drain(self) -> None:
        """Within :meth:`admitted` (or exclusively): waits until no shared holder runs;
        the caller then holds the lock exclusively."""
        self._writers_waiting += 1
        try:
            while self._readers:
                self._sleep(None)
        finally:
            self._writers_waiting -= 1

    def join(self) -> None:
        """Within :meth:`admitted`: the caller holds the lock shared until :meth:`leave`."""
        self._readers += 1

    def leave(self) -> None:
        """A shared holder is done."""
        with self._mutex:
            self._readers -= 1
            if not self._readers and self._sleepers:
                self._changed.notify_all()

    def _sleep(self, timeout: float | None) -> None:
        self._sleepers += 1
        try:
            self._changed.wait(timeout)
        finally:
            self._sleepers -= 1
