"""A call in flight, whatever road it took: what the SDK's fan-out waits on.

A call to a worker is started (sent) and then awaited, as gRPC's
``multi_callable.future(request)`` and ``future.result()``: sending to several
workers first and then waiting puts their calls in flight together from one
thread. :class:`Call` is that shape; the transport returns one for a call on a
lane or a gRPC call alike (``WorkerEndpoint.unary(method).future(...)``), and
:class:`Job` is work that blocks (a put, then a call, then a get; or a gRPC call,
whose future would start a thread of gRPC's on an idle channel) for the fan-out
to run on a thread of its choosing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Call", "Done", "Job", "Mapped", "Start"]

R = TypeVar("R")
S = TypeVar("S")
R_co = TypeVar("R_co", covariant=True)


class Call(Protocol[R_co]):
    """A started call: :meth:`result` waits for its answer."""

    def result(self) -> R_co:
        """The call's answer.

        Raises:
            CollectiveError: the call failed.
        """
        ...


# What starts one rank's call in a fan-out (run on the caller's thread).
Start = Callable[[], Call[R]]


class Done(Generic[R]):
    """A call that already ended, with ``value`` or raising ``error``."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: R | None = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    def result(self) -> R:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class Mapped(Generic[S, R]):
    """The call ``inner``, its answer passed through ``then`` (on the waiting thread)."""

    __slots__ = ("_inner", "_then")

    def __init__(self, inner: Call[S], then: Callable[[S], R]) -> None:
        self._inner = inner
        self._then = then

    def result(self) -> R:
        return self._then(self._inner.result())


class Job(Generic[R]):
    """Blocking work, not started: ``fn`` runs on a thread the fan-out chooses (the
    pool, or the caller's for the last one), its return value the call's answer;
    awaited outside a fan-out, it runs then, on the awaiting thread. A Job is its own
    start (calling it returns it), and a start may return one."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], R]) -> None:
        self.fn = fn

    def __call__(self) -> Job[R]:
        return self

    def result(self) -> R:
        return self.fn()
