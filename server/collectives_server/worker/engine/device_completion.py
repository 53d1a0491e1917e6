"""An accelerator data group whose ``wait()`` means the collective has completed.

On gloo, ``Work.wait()`` returns once the data is where it belongs. On NCCL it
does not: it makes the caller's current CUDA stream wait for the collective and
returns at once, while the kernel may still be running, or never finish (a
peer died inside it). The engine's rule is that ranks agree and commit only
after every rank holds its result, so every kernel and handler waits on its
works as on gloo, and this wrapper makes that true on the device: ``wait()``
orders the stream as NCCL does, then polls the work's completion on the device
until it completes or the op's timeout passes, and raises when it failed or
did not complete. Op times and the flight record then measure completion,
not the enqueue.

:class:`CompletingGroup` wraps the NCCL data group (:func:`process_groups.build_groups`);
anything else passes through unchanged. :meth:`CompletingGroup.abort` ends the
communicator of a broken or superseded generation, so that a kernel spinning
on a dead peer is torn down rather than blocking every later op on the stream.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["CompletingGroup", "CompletingWork", "DeviceTimeout"]

# The methods that enqueue a collective or point-to-point transfer and return a Work.
_ENQUEUING = frozenset(
    {
        "allreduce",
        "allreduce_coalesced",
        "allgather",
        "_allgather_base",
        "allgather_into_tensor_coalesced",
        "broadcast",
        "gather",
        "scatter",
        "reduce",
        "reduce_scatter",
        "_reduce_scatter_base",
        "alltoall",
        "alltoall_base",
        "send",
        "recv",
        "barrier",
        "_end_coalescing",  # a group call's (batch_isend_irecv's) one work
    }
)
# Completion polling: starts fine (a small op completes in microseconds), backs off
# to a bound that keeps a long op's added latency small.
_FIRST_POLL_S = 20e-6
_MAX_POLL_S = 2e-3


class DeviceTimeout(RuntimeError):
    """A collective that did not complete on the device within the op's timeout: a
    RuntimeError saying "timed out", like the backends' own, so the engine reads it as
    a transport failure (the group is broken, ``op_failures``)."""


class CompletingWork:
    """A Work whose :meth:`wait` returns once the collective completed on the device."""

    def __init__(self, work: Any, timeout_s: float, what: str) -> None:
        self._work = work
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._what = what

    def wait(self, timeout: Any = None) -> bool:
        """Raises the backend's error (a RuntimeError) if the collective failed, and
        :class:`DeviceTimeout` if it did not complete within the op's timeout."""
        self._work.wait()  # stream ordering, and an error already known
        pause = threading.Event()  # never set: a bounded wait between polls
        delay = _FIRST_POLL_S
        while not self._work.is_completed():
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise DeviceTimeout(
                    f"{self._what} timed out on the device: not complete within "
                    f"{self._timeout_s:g} s (a peer stopped or died inside it)"
                )
            pause.wait(min(delay, left))
            delay = min(delay * 2, _MAX_POLL_S)
        self._work.wait()  # a completed work that failed raises here
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CompletingGroup:
    """Wraps an accelerator process group: every enqueuing call returns a
    :class:`CompletingWork`; other attributes are the group's own."""

    def __init__(self, pg: Any, timeout_s: float) -> None:
        self._pg = pg
        self.timeout_s = timeout_s
        self.aborted = False

    @property
    def wrapped(self) -> Any:
        """The process group itself (for what must see the real object)."""
        return self._pg

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._pg, name)
        if name not in _ENQUEUING:
            return attr

        def enqueue(*args: Any, **kwargs: Any) -> CompletingWork:
            return CompletingWork(attr(*args, **kwargs), self.timeout_s, name)

        return enqueue

    def abort(self) -> None:
        """Ends the communicator now, in-flight kernels included; idempotent. A group
        without ``abort`` (not NCCL) is shut down if it can be."""
        if self.aborted:
            return
        self.aborted = True
        for method in ("abort", "shutdown"):
            end = getattr(self._pg, method, None)
            if end is not None:
                end()
                return
