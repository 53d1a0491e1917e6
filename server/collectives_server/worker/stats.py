"""The worker's counters: ops by kind and outcome, latencies, bytes moved, heartbeats.

Every op, collective or data-plane, goes through :meth:`WorkerStats.record`,
which also keeps each kind's recent rate and latency percentiles
(:mod:`windows`) and groups failures (:mod:`error_groups`); collectives add
their modelled traffic with :meth:`WorkerStats.add_collective_bytes`
(:mod:`collective_traffic`); the RPC guards note the callers in ``clients``
(:mod:`clients`). :mod:`status` turns the counters into the ``WorkerStatus``
message and :mod:`metrics` into Prometheus metrics.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from dataclasses import dataclass, field

import grpc

from collectives.v1 import status_pb2
from collectives_server.worker.telemetry.clients import ClientTable
from collectives_server.worker.telemetry.error_groups import ErrorGroups
from collectives_server.worker.telemetry.windows import LatencyWindow, WindowedRate

__all__ = ["LATENCY_BUCKETS_S", "RECENT_ERRORS", "KindSummary", "WorkerStats", "status_label"]

# How many failed ops GetState/heartbeats report.
RECENT_ERRORS = 20
# Upper bounds of the op latency histogram (seconds); +Inf is implied.
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
)  # fmt: skip


def status_label(code: grpc.StatusCode | None) -> str:
    """``ok`` or the gRPC code name in lower case (``not_found``): the metrics' status label."""
    return "ok" if code is None or code == grpc.StatusCode.OK else code.name.lower()


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, value)] += 1
        self.total_s += value


@dataclass
class _KindWindows:
    rate: WindowedRate = field(default_factory=WindowedRate)
    latency: LatencyWindow = field(default_factory=LatencyWindow)


@dataclass(frozen=True)
class KindSummary:
    """One kind's recent rate (ops/s, completed and failed) and latency percentiles."""

    rate_per_s: float
    p50_s: float
    p99_s: float


@dataclass
class WorkerStats:
    """The worker's counters. Update them through the methods (they take ``lock``)."""

    bytes_in: int = 0
    bytes_out: int = 0
    ops_completed: collections.Counter = field(default_factory=collections.Counter)
    ops_failed: collections.Counter = field(default_factory=collections.Counter)
    last_op: str = ""
    last_op_latency_s: float = 0.0
    # (kind, status label) -> count; see status_label().
    ops_by_status: collections.Counter = field(default_factory=collections.Counter)
    latency: dict[str, _Histogram] = field(default_factory=dict)
    # Leader: rank -> agreed ops that waited for it (collectives_op_straggler_total).
    stragglers: dict[int, int] = field(default_factory=dict)
    recent_errors: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_ERRORS)
    )
    data_collectives: int = 0
    gradient_buckets_reduced: int = 0
    # Fused announcements (several queued small ops in one exchange) and their ops.
    fused_runs: int = 0
    fused_ops: int = 0
    heartbeats_sent: int = 0
    heartbeat_failures: int = 0
    # Ops the SDK sent again for this generation after a drain's change (never run before).
    ops_reissued: int = 0
    # kind -> recent rate and latencies; kind -> (received, sent) collective bytes.
    windows: dict[str, _KindWindows] = field(default_factory=dict)
    collective_bytes: dict[str, list[int]] = field(default_factory=dict)
    error_groups: ErrorGroups = field(default_factory=ErrorGroups)
    # Has a lock of its own: the RPC guards note every call's client.
    clients: ClientTable = field(default_factory=ClientTable)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(
        self,
        kind: str,
        code: grpc.StatusCode | None,
        latency_s: float,
        *,
        op_id: int = 0,
        generation: int = 0,
        message: str = "",
    ) -> None:
        """Counts one op of ``kind``; ``code`` None or OK means it succeeded."""
        ok = code is None or code == grpc.StatusCode.OK
        now_s = time.monotonic()
        with self.lock:
            (self.ops_completed if ok else self.ops_failed)[kind] += 1
            self.ops_by_status[(kind, status_label(code))] += 1
            self.latency.setdefault(kind, _Histogram()).observe(latency_s)
            windows = self.windows.get(kind)
            if windows is None:
                windows = self.windows[kind] = _KindWindows()
            windows.rate.add(now_s)
            windows.latency.add(latency_s)
            self.last_op = kind
            self.last_op_latency_s = latency_s
            if not ok:
                assert code is not None
                self.recent_errors.append(
                    status_pb2.RecentError(
                        unix_time_s=time.time(),
                        op_id=op_id,
                        generation=generation,
                        kind=kind,
                        code=code.name,
                        message=message,
                    )
                )
                self.error_groups.record(kind, code.name, message, op_id)

    def add_bytes(self, *, received: int = 0, sent: int = 0) -> None:
        """Data-plane payload bytes: received by PutTensor, sent by GetTensor."""
        with self.lock:
            self.bytes_in += received
            self.bytes_out += sent

    def add_collective_bytes(self, kind: str, *, received: int, sent: int) -> None:
        """A collective's modelled payload traffic on this rank (``collective_traffic``)."""
        if not received and not sent:
            return
        with self.lock:
            moved = self.collective_bytes.setdefault(kind, [0, 0])
            moved[0] += received
            moved[1] += sent

    def attribute_failure(self, code: grpc.StatusCode, message: str, client: str) -> None:
        """Names the client whose call failed with ``code`` and ``message``."""
        with self.lock:
            self.error_groups.attribute(code.name, message, client)

    def record_fused(self, ops: int) -> None:
        """One fused announcement that carried ``ops`` queued small ops."""
        with self.lock:
            self.fused_runs += 1
            self.fused_ops += ops

    def record_straggler(self, rank: int) -> None:
        """Leader: an agreed op waited for ``rank`` (the last to reach it)."""
        with self.lock:
            self.stragglers[rank] = self.stragglers.get(rank, 0) + 1

    def record_data_collectives(self, collectives: int, gradient_buckets: int) -> None:
        """Data collectives a model op issued, and the gradient buckets among them."""
        with self.lock:
            self.data_collectives += collectives
            self.gradient_buckets_reduced += gradient_buckets

    def kind_summaries(self) -> dict[str, KindSummary]:
        """kind -> its recent rate and latency p50/p99 (call with ``lock`` held)."""
        now_s = time.monotonic()
        out = {}
        for kind, w in self.windows.items():
            p50, p99 = w.latency.percentiles(50, 99)
            out[kind] = KindSummary(w.rate.rate(now_s), p50, p99)
        return out

    def op_reissued(self) -> None:
        with self.lock:
            self.ops_reissued += 1

    def heartbeat(self, ok: bool) -> None:
        with self.lock:
            if ok:
                self.heartbeats_sent += 1
            else:
                self.heartbeat_failures += 1

    def latency_snapshot(self) -> dict[str, tuple[list[int], float]]:
        """kind -> (per-bucket counts, the last one +Inf; sum of latencies)."""
        with self.lock:
            return {k: (list(h.counts), h.total_s) for k, h in self.latency.items()}
