"""What a call's handler, guards and interceptors may use of its context.

A worker method runs on two roads: a gRPC call, whose context is grpc's
``ServicerContext``, and a call lane (``worker.transport.lanes.LaneContext``). Both
provide :class:`CallContext`, and the code that runs on either is typed against
it, so a method it lacks is a type error rather than a surprise on one road.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

import grpc

__all__ = ["CallContext"]


class CallContext(Protocol):
    """A live call, as its server side sees it."""

    def peer(self) -> str:
        """The client's address (``ipv4:127.0.0.1:5000``)."""
        ...

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]:
        """The call's request metadata (a lane: its ticket call's)."""
        ...

    def time_remaining(self) -> float | None:
        """Seconds left of the client's deadline; None: the call has none."""
        ...

    def is_active(self) -> bool:
        """False once the call ended: answered, cancelled, or past its deadline."""
        ...

    def cancel(self) -> None:
        """Ends the call now (the data-plane watchdog's bound)."""
        ...

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Runs ``callback`` when the call ends; False if it ended already."""
        ...

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """Ends the call with ``code`` and ``details`` (raises)."""
        ...

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        """Ends the call with ``status``, trailers included (raises)."""
        ...

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, Any]]) -> None: ...
