"""The handle an ``async_op=True`` call returns, like ``torch.distributed.Work``.

It wraps a ``concurrent.futures.Future`` so that waiting on it speaks the SDK's
error vocabulary: a wait that runs out of time raises
:class:`~collectives.errors.DeadlineExceeded` (a ``TimeoutError``), and the
op's own failure is raised as the same :class:`~collectives.errors.CollectiveError`
the synchronous call would have raised.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Generic, TypeVar

from collectives.errors import DeadlineExceeded, Unavailable

__all__ = ["Work", "IssuedOp"]

T = TypeVar("T")


@dataclass
class IssuedOp:
    """What the SDK learns about an op while it runs: the generation it ran in."""

    generation: int | None = None


class Work(Generic[T]):
    """A pending collective: ``.result()``/``.wait()`` return what the sync call returns."""

    def __init__(
        self,
        future: concurrent.futures.Future[T],
        description: str = "op",
        record: IssuedOp | None = None,
    ) -> None:
        self._future = future
        self._description = description
        self._record = record if record is not None else IssuedOp()

    @property
    def generation(self) -> int | None:
        """The generation the op was sent for (it runs there or fails); None before it is sent.

        Once the op succeeded this is the generation it ran in; a failed op's
        error carries the same value as ``err.generation``.
        """
        return self._record.generation

    def result(self, timeout: float | None = None) -> T:
        """Blocks until the op finishes and returns its result.

        Args:
            timeout: seconds to wait; None waits until the op finishes.
                Defaults to ``None``.

        Returns:
            What the synchronous call returns.

        Raises:
            DeadlineExceeded: the op did not finish within ``timeout`` seconds
                (it keeps running; call again to keep waiting).
            Unavailable: the op never started because the ``Cluster`` was closed.
            CollectiveError: the op failed (the same error the sync call raises).
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.CancelledError:
            raise _cancelled(self._description) from None
        except TimeoutError as exc:  # concurrent.futures.TimeoutError is TimeoutError
            if self._future.done() and self._future.exception() is exc:
                raise  # the op's own DeadlineExceeded, not our wait running out
            raise DeadlineExceeded(
                f"{self._description} did not finish within {timeout} s"
            ) from None

    def wait(self, timeout: float | None = None) -> T:
        """Same as :meth:`result` (``torch.distributed.Work.wait`` spelling).

        Args:
            timeout: seconds to wait; None waits until the op finishes.
                Defaults to ``None``.

        Returns:
            What the synchronous call returns.

        Raises:
            DeadlineExceeded: the op did not finish within ``timeout`` seconds
                (it keeps running; call again to keep waiting).
            Unavailable: the op never started because the ``Cluster`` was closed.
            CollectiveError: the op failed (the same error the sync call raises).
        """
        return self.result(timeout)

    def done(self) -> bool:
        """True once the op finished, successfully or not.

        Returns:
            Whether the op finished.
        """
        return self._future.done()

    def is_completed(self) -> bool:
        """Alias of :meth:`done` (``torch.distributed.Work.is_completed`` spelling).

        Returns:
            Whether the op finished.
        """
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The op's error, or None if it succeeded; waits up to ``timeout`` seconds.

        Args:
            timeout: seconds to wait; None waits until the op finishes.
                Defaults to ``None``.

        Returns:
            The ``CollectiveError`` the op failed with (``Unavailable`` for an op
            cancelled by ``close``), or None.

        Raises:
            DeadlineExceeded: the op did not finish within ``timeout`` seconds
                (it keeps running).
        """
        try:
            return self._future.exception(timeout)
        except concurrent.futures.CancelledError:
            return _cancelled(self._description)
        except TimeoutError:
            raise DeadlineExceeded(
                f"{self._description} did not finish within {timeout} s"
            ) from None

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<Work {self._description} {state}>"


def _cancelled(description: str) -> Unavailable:
    return Unavailable(f"{description} never ran: the cluster was closed first", executed=False)
