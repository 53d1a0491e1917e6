"""What a worker reports about itself: counters, the WorkerStatus message, per-op logs.

:class:`WorkerStats` holds the worker's counters (ops by kind and outcome, op
latencies, bytes moved, heartbeats, recent errors); every op, collective or
data-plane, goes through :meth:`WorkerStats.record`. :func:`collect_status`
builds the ``WorkerStatus`` message that every heartbeat carries and GetState
answers; the metrics endpoint reads the same counters (``worker/metrics.py``).
:func:`op_done` is the daemon's per-op hook: it records the op and logs one line
for it (DEBUG; failures WARNING on the leader) with the ids as log fields.
"""

from __future__ import annotations

import bisect
import collections
import functools
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import torch

import collectives_server
from collectives.errors import CollectiveError
from collectives.op_specs import kind_name, spec, subject
from collectives.v1 import status_pb2, worker_pb2

if TYPE_CHECKING:
    from collectives_server.worker.daemon import WorkerDaemon
    from collectives_server.worker.op_context import OpResult

__all__ = [
    "LATENCY_BUCKETS_S",
    "RECENT_ERRORS",
    "WorkerStats",
    "backend_version",
    "collect_status",
    "data_op_done",
    "heartbeat_status",
    "memory_status",
    "op_done",
    "status_label",
]

log = logging.getLogger(__name__)
# Per-op log lines go to this logger, so operators can raise or lower them alone.
op_log = logging.getLogger("collectives_server.worker.ops")

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
class WorkerStats:
    """The worker's counters. Update them through the methods (they take ``lock``).

    ``data_collectives`` and ``gradient_buckets_reduced`` are plain counters that
    the model code increments from the generation's thread.
    """

    bytes_in: int = 0
    bytes_out: int = 0
    ops_completed: collections.Counter = field(default_factory=collections.Counter)
    ops_failed: collections.Counter = field(default_factory=collections.Counter)
    last_op: str = ""
    last_op_latency_s: float = 0.0
    # (kind, status label) -> count; see status_label().
    ops_by_status: collections.Counter = field(default_factory=collections.Counter)
    latency: dict[str, _Histogram] = field(default_factory=dict)
    recent_errors: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_ERRORS)
    )
    data_collectives: int = 0
    gradient_buckets_reduced: int = 0
    heartbeats_sent: int = 0
    heartbeat_failures: int = 0
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
        with self.lock:
            (self.ops_completed if ok else self.ops_failed)[kind] += 1
            self.ops_by_status[(kind, status_label(code))] += 1
            self.latency.setdefault(kind, _Histogram()).observe(latency_s)
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

    def add_bytes(self, *, received: int = 0, sent: int = 0) -> None:
        """Data-plane payload bytes: received by PutTensor, sent by GetTensor."""
        with self.lock:
            self.bytes_in += received
            self.bytes_out += sent

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


# ----------------------------------------------------------------------- status


@functools.cache
def backend_version(backend: str) -> str:
    """gloo ships inside torch (its version is torch's); NCCL reports its own."""
    if backend == "nccl":
        try:
            return ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # no NCCL in this build
            return ""
    return torch.__version__


def _meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of the host in bytes; zeros where /proc is missing."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return values.get("MemTotal", 0), values.get("MemAvailable", 0)


def _rss_bytes() -> int:
    """This process's resident set size (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_status(
    devices: list[torch.device],
) -> tuple[list[status_pb2.DeviceStatus], int, int, int]:
    """(per-device memory, process RSS, host total, host available), all in bytes.

    CUDA devices report ``torch.cuda.mem_get_info`` (used = total - free, every
    process on the GPU); the CPU reports this process's RSS of the host's memory.
    """
    rss = _rss_bytes()
    host_total, host_available = _meminfo()
    out = []
    for device in devices:
        used, total = rss, host_total
        if device.type == "cuda":
            try:
                free, total = torch.cuda.mem_get_info(device)
                used = total - free
            except Exception:  # a GPU in a bad state must not break heartbeats
                used = total = 0
        out.append(
            status_pb2.DeviceStatus(
                device=str(device), memory_used_bytes=used, memory_total_bytes=total
            )
        )
    return out, rss, host_total, host_available


def collect_status(daemon: WorkerDaemon) -> status_pb2.WorkerStatus:
    """The worker's status as heartbeats carry it and GetState answers it."""
    count, nbytes = daemon.store.stats()
    runtime = daemon.runtime
    devices, rss, host_total, host_available = memory_status(daemon.devices)
    msg = status_pb2.WorkerStatus(
        tensors_held=count,
        bytes_held=nbytes,
        queue_depth=runtime.queue_depth if runtime is not None else 0,
        devices=devices,
        package_version=collectives_server.__version__,
        torch_version=torch.__version__,
        backend_version=backend_version(daemon.backend),
        process_rss_bytes=rss,
        host_memory_total_bytes=host_total,
        host_memory_available_bytes=host_available,
    )
    # The model registry (worker/models.py) may be absent in a build without models.
    models = getattr(daemon, "models", None)
    if models is not None:
        msg.models.extend(sorted(models.names()))
        msg.graphs_retained = models.graphs_retained()
    stats = daemon.stats
    with stats.lock:
        for kind in sorted(set(stats.ops_completed) | set(stats.ops_failed)):
            msg.ops.add(
                kind=kind, completed=stats.ops_completed[kind], failed=stats.ops_failed[kind]
            )
        msg.last_op = stats.last_op
        msg.last_op_latency_s = stats.last_op_latency_s
        msg.bytes_received = stats.bytes_in
        msg.bytes_sent = stats.bytes_out
        msg.recent_errors.extend(stats.recent_errors)
        msg.data_collectives = stats.data_collectives
        msg.gradient_buckets_reduced = stats.gradient_buckets_reduced
    return msg


# ------------------------------------------------------------------ the op hook


def _operand_bytes(kind: int, outcome: Any, group_size: int) -> int:
    """Bytes of one rank's operand, from the result's dtype and shape (0 if unknown)."""
    dtype, shape = getattr(outcome, "dtype", None), tuple(getattr(outcome, "shape", ()) or ())
    return spec(kind).operand_nbytes(dtype, shape, group_size)


def _group_ranks(daemon: WorkerDaemon, desc: worker_pb2.OpDescriptor) -> list[int]:
    if desc.WhichOneof("args") == "new_group":
        return list(desc.new_group.ranks)
    runtime = daemon.runtime
    if runtime is None or runtime.generation != desc.generation:
        return []
    group = runtime.groups.get(desc.group_id)
    return list(group.ranks) if group is not None else []


def _op_done(
    daemon: WorkerDaemon,
    desc: worker_pb2.OpDescriptor,
    outcome: OpResult | CollectiveError,
    latency_s: float,
) -> None:
    """Counts a finished op and logs it: one DEBUG line, or WARNING for a failure on the leader.

    The fields (``op_id``, ``generation``, ``kind``, ...) are log-record extras, so
    ``--log-format json`` makes them searchable; the text line carries them too.
    """
    failed = isinstance(outcome, CollectiveError)
    code = outcome.code if failed else None
    kind, tensor = kind_name(desc.kind), subject(desc)
    daemon.stats.record(
        kind,
        code,
        latency_s,
        op_id=desc.op_id,
        generation=desc.generation,
        message=outcome.message if failed else "",
    )
    ranks = _group_ranks(daemon, desc)
    level = logging.DEBUG
    if failed:
        runtime = daemon.runtime
        leader = runtime is not None and runtime.is_leader and runtime.generation == desc.generation
        level = logging.WARNING if leader else logging.DEBUG
    if not op_log.isEnabledFor(level):
        return
    nbytes = 0 if failed else _operand_bytes(desc.kind, outcome, len(ranks))
    extra = {
        "op_id": desc.op_id,
        "generation": desc.generation,
        "kind": kind,
        "tensor": tensor,
        "ranks": ranks,
        "bytes": nbytes,
        "latency_s": round(latency_s, 6),
        "code": code.name if code is not None else "OK",
    }
    if failed:
        op_log.log(
            level,
            "op %d (%s %r) generation %d ranks %s failed in %.3f s: %s: %s",
            desc.op_id, kind, tensor, desc.generation, ranks, latency_s,
            code.name, outcome.message, extra=extra,
        )  # fmt: skip
    else:
        op_log.log(
            level,
            "op %d (%s %r) generation %d ranks %s: %d bytes in %.3f s",
            desc.op_id, kind, tensor, desc.generation, ranks, nbytes, latency_s,
            extra=extra,
        )  # fmt: skip


def _data_op_done(
    daemon: WorkerDaemon,
    kind: str,
    name: str,
    code: grpc.StatusCode | None,
    message: str,
    latency_s: float,
) -> None:
    """Counts a data-plane call (put, get, delete) and logs it at DEBUG (failures at INFO)."""
    runtime = daemon.runtime
    generation = runtime.generation if runtime is not None else 0
    daemon.stats.record(kind, code, latency_s, generation=generation, message=message)
    failed = code is not None and code != grpc.StatusCode.OK
    level = logging.INFO if failed else logging.DEBUG
    if not op_log.isEnabledFor(level):
        return
    extra = {
        "generation": generation,
        "kind": kind,
        "tensor": name,
        "latency_s": round(latency_s, 6),
        "code": code.name if code is not None else "OK",
    }
    if failed:
        assert code is not None
        op_log.log(level, "%s %r failed in %.3f s: %s: %s", kind, name, latency_s, code.name,
                   message, extra=extra)  # fmt: skip
    else:
        op_log.log(level, "%s %r in %.3f s", kind, name, latency_s, extra=extra)


def heartbeat_status(daemon: WorkerDaemon) -> status_pb2.WorkerStatus | None:
    """The status for a heartbeat; None (logged) if collecting it failed, so that a bug
    here can never stop the heartbeats that keep the worker in the cluster."""
    try:
        return collect_status(daemon)
    except Exception:
        log.exception("collecting the worker status failed; heartbeat sent without it")
        return None


def op_done(
    daemon: WorkerDaemon,
    desc: worker_pb2.OpDescriptor,
    outcome: OpResult | CollectiveError,
    latency_s: float,
) -> None:
    """Counts a finished collective and logs it (see :func:`_op_done`); never raises,
    because it runs on the generation's thread, which must not die for a statistic."""
    try:
        _op_done(daemon, desc, outcome, latency_s)
    except Exception:
        log.exception("recording op %d (%s) failed", desc.op_id, kind_name(desc.kind))


def data_op_done(
    daemon: WorkerDaemon,
    kind: str,
    name: str,
    code: grpc.StatusCode | None,
    message: str,
    latency_s: float,
) -> None:
    """Counts a data-plane call and logs it (see :func:`_data_op_done`); never raises."""
    try:
        _data_op_done(daemon, kind, name, code, message, latency_s)
    except Exception:
        log.exception("recording %s %r failed", kind, name)
