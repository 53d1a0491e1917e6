"""Bounds on what one gRPC call to a worker may hold: a slot, a thread, time.

A few dozen ``PutTensor`` streams that send a header and one chunk and then
nothing, with no deadline, held every thread of a worker's gRPC pool
forever; health checks and ``GetState`` timed out while the worker kept
heartbeating. Three bounds, applied by :class:`DataPlaneLimits` (a server
interceptor) to every call of the worker service except the cheap state and
discovery calls:

* **slots**: at most ``max_data_streams`` such calls at once, and
  ``max_data_streams_per_peer`` from one peer host; beyond, RESOURCE_EXHAUSTED
  at once. The gRPC pool has :func:`pool_size` threads, so calls holding a slot
  can never take the threads that health, state and control calls need;
* **idle**: a call that streams requests or responses and makes no progress
  (no request received, no response taken by the client) for
  ``stream_idle_s`` is cancelled;
* **duration**: no call runs longer than ``max_rpc_s``, whatever deadline the
  client gave (or did not give).

Cancelled calls end on the client with CANCELLED (the SDK's DeadlineExceeded);
one watchdog thread watches every call (:class:`Watchdog`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from collectives_server.rpc.call_context import CallContext
from collectives_server.settings import DATA_PLANE, positive_float, positive_int, setting

__all__ = [
    "DataPlaneLimits",
    "RpcLimits",
    "StreamSlots",
    "Watchdog",
    "peer_host",
    "pool_size",
]

log = logging.getLogger(__name__)

# Threads kept for calls outside the data plane (health, GetState, GetFlightRecord,
# reflection).
RESERVED_THREADS = 16
_WORKER_SERVICE = "/collectives.v1.Worker/"
# Worker methods that answer at once from memory: never limited.
_EXEMPT = frozenset({"GetState", "GetDataPlane", "GetFlightRecord"})


@dataclass(frozen=True)
class RpcLimits:
    """The bounds of one worker's gRPC data plane."""

    max_rpc_s: float = setting(
        300.0,
        flag="--max-rpc-s",
        parse=positive_float,
        metavar="S",
        group=DATA_PLANE,
        help="longest any call may run, whatever the client's deadline, seconds",
    )
    stream_idle_s: float = setting(
        10.0,
        flag="--stream-idle-s",
        parse=positive_float,
        metavar="S",
        group=DATA_PLANE,
        help="cancel a streaming call that makes no progress this long, seconds",
    )
    max_data_streams: int = setting(
        96,
        flag="--max-data-streams",
        parse=positive_int,
        metavar="N",
        group=DATA_PLANE,
        help="data-plane calls (tensors, collectives, models) at once; more answer "
        "RESOURCE_EXHAUSTED",
    )
    max_data_streams_per_peer: int = setting(
        80,
        flag="--max-data-streams-per-peer",
        parse=positive_int,
        metavar="N",
        group=DATA_PLANE,
        help="the same, from one client host",
    )


def pool_size(limits: RpcLimits) -> int:
    """gRPC threads: every data-plane slot, plus threads no data-plane call can take."""
    return limits.max_data_streams + RESERVED_THREADS


def peer_host(peer: str) -> str:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` → the host part."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    if rest.startswith("["):
        return rest[1:].partition("]")[0]
    return rest.rpartition(":")[0]


class StreamSlots:
    """Counts calls in progress, in all and per peer host."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self._lock = threading.Lock()
        self._by_peer: Counter[str] = Counter()
        self.active = 0

    def acquire(self, peer: str) -> str | None:
        """None if admitted, else why not."""
        with self._lock:
            if self.active >= self.total:
                return (
                    f"the worker is serving {self.active} data-plane calls, its limit "
                    f"(--max-data-streams {self.total}); retry later"
                )
            if self._by_peer[peer] >= self.per_peer:
                return (
                    f"{self._by_peer[peer]} data-plane calls from {peer} are in progress, "
                    f"the limit per host (--max-data-streams-per-peer {self.per_peer})"
                )
            self.active += 1
            self._by_peer[peer] += 1
            return None

    def release(self, peer: str) -> None:
        with self._lock:
            self.active -= 1
            self._by_peer[peer] -= 1
            if self._by_peer[peer] <= 0:
                del self._by_peer[peer]


class Watch:
    """One watched call: :meth:`touch` on progress, :meth:`done` at its end."""

    def __init__(self, watchdog: Watchdog, key: int, cancel: Callable[[], None]) -> None:
        self._watchdog, self.key, self.cancel = watchdog, key, cancel
        self.idle_deadline: float | None = None
        self.hard_deadline = 0.0
        self.reason = ""

    def touch(self) -> None:
        self._watchdog.touch(self)

    def done(self) -> None:
        self._watchdog.forget(self)


class Watchdog:
    """Cancels calls that make no progress for ``idle_s`` or run past ``max_s``.

    Pure bookkeeping in :meth:`expire` (tested with a fake clock); one daemon
    thread calls it at the next deadline.
    """

    def __init__(
        self,
        idle_s: float,
        max_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_cancel: Callable[[str], None] | None = None,
        start_thread: bool = True,
    ) -> None:
        self.idle_s, self.max_s, self._clock = idle_s, max_s, clock
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._watches: dict[int, Watch] = {}
        self._heap: list[tuple[float, int]] = []
        self._keys = itertools.count()
        self._closed = False
        self._wake_at: float | None = None  # when the thread wakes next (None: not waiting)
        if start_thread:
            threading.Thread(target=self._run, name="rpc-watchdog", daemon=True).start()

    def watch(self, cancel: Callable[[], None], idle: bool) -> Watch:
        now = self._clock()
        w = Watch(self, next(self._keys), cancel)
        w.hard_deadline = now + self.max_s
        w.idle_deadline = now + self.idle_s if idle else None
        deadline = self._next_deadline(w)
        with self._cond:
            self._watches[w.key] = w
            heapq.heappush(self._heap, (deadline, w.key))
            # Woken only when this deadline comes before its planned wake-up: a
            # notify per call was a thread switch per collective (~2.7 per small op).
            if self._wake_at is None or deadline < self._wake_at:
                self._cond.notify()
        return w

    def touch(self, w: Watch) -> None:
        if w.idle_deadline is not None:
            w.idle_deadline = self._clock() + self.idle_s  # read by expire() under the lock

    def forget(self, w: Watch) -> None:
        with self._cond:
            self._watches.pop(w.key, None)
            # An ended call's entry stays in the heap until its deadline (max_s for a
            # unary call): at hundreds of calls per second, rebuild it from the live
            # watches once most entries are dead, so it stays proportional to them.
            if len(self._heap) > 2 * len(self._watches) + 64:
                self._heap = [(self._next_deadline(x), k) for k, x in self._watches.items()]
                heapq.heapify(self._heap)

    @property
    def heap_size(self) -> int:
        with self._cond:
            return len(self._heap)

    def expire(self) -> tuple[list[Watch], float | None]:
        """Removes and returns the watches past a deadline, and the next deadline."""
        now = self._clock()
        expired = []
        with self._cond:
            while self._heap and self._heap[0][0] <= now:
                _, key = heapq.heappop(self._heap)
                w = self._watches.get(key)
                if w is None:
                    continue
                if now >= w.hard_deadline:
                    w.reason = f"ran longer than --max-rpc-s {self.max_s:g}"
                elif w.idle_deadline is not None and now >= w.idle_deadline:
                    w.reason = f"made no progress for --stream-idle-s {self.idle_s:g}"
                else:  # touched since: watch again at its new deadline
                    heapq.heappush(self._heap, (self._next_deadline(w), key))
                    continue
                del self._watches[key]
                expired.append(w)
            next_deadline = self._heap[0][0] if self._heap else None
        return expired, next_deadline

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _next_deadline(self, w: Watch) -> float:
        if w.idle_deadline is None:
            return w.hard_deadline
        return min(w.hard_deadline, w.idle_deadline)

    def _run(self) -> None:
        while True:
            expired, next_deadline = self.expire()
            for w in expired:
                log.info("cancelling a call that %s", w.reason)
                if self._on_cancel is not None:
                    self._on_cancel("idle" if "progress" in w.reason else "max_duration")
                try:
                    w.cancel()
                except Exception:  # a call that ended meanwhile: nothing to cancel
                    log.debug("cancelling an ended call", exc_info=True)
            with self._cond:
                if self._closed:
                    return
                if self._heap and self._heap[0][0] <= self._clock():
                    continue
                now = self._clock()
                wait = self.idle_s
                if next_deadline is not None:
                    wait = min(max(next_deadline - now, 0), self.idle_s)
                self._wake_at = now + wait
                self._cond.wait(wait)
                self._wake_at = None


class DataPlaneLimits(grpc.ServerInterceptor):
    """Applies :class:`StreamSlots` and :class:`Watchdog` to the worker service's calls."""

    def __init__(self, limits: RpcLimits, on_abort: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.slots = StreamSlots(limits.max_data_streams, limits.max_data_streams_per_peer)
        self._on_abort = on_abort
        self.watchdog = Watchdog(limits.stream_idle_s, limits.max_rpc_s, on_cancel=on_abort)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_WORKER_SERVICE):
            return handler
        if method[len(_WORKER_SERVICE) :] in _EXEMPT:
            return handler
        return _limited(handler, self)

    def close(self) -> None:
        self.watchdog.close()


def _admit(limits: DataPlaneLimits, context: CallContext, idle: bool):
    peer = peer_host(context.peer())
    refusal = limits.slots.acquire(peer)
    if refusal is not None:
        if limits._on_abort is not None:
            limits._on_abort("slots")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
    return peer, limits.watchdog.watch(context.cancel, idle)


def _touching(items: Iterator[Any], watch: Watch) -> Iterator[Any]:
    for item in items:
        watch.touch()
        yield item


def _reading(requests: Iterator[Any], watch: Watch) -> Iterator[Any]:
    """The request stream, touching on each message; once it ended, only the
    duration bound applies (the handler may then work for long, e.g. a model load)."""
    yield from _touching(requests, watch)
    watch.idle_deadline = None


def _limited(handler: grpc.RpcMethodHandler, limits: DataPlaneLimits) -> grpc.RpcMethodHandler:
    inner = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )

    def unary_response(request: Any, context: CallContext) -> Any:
        peer, watch = _admit(limits, context, handler.request_streaming)
        try:
            if handler.request_streaming:
                request = _reading(request, watch)
            return inner(request, context)
        finally:
            watch.done()
            limits.slots.release(peer)

    def stream_response(request: Any, context: CallContext) -> Iterator[Any]:
        peer, watch = _admit(limits, context, True)
        try:
            if handler.request_streaming:
                request = _touching(request, watch)
            # Each response the client takes is progress; one it does not take
            # blocks here, and the idle bound cancels the call.
            yield from _touching(inner(request, context), watch)
        finally:
            watch.done()
            limits.slots.release(peer)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_response, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_response, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream_response, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary_response, **kwargs)
