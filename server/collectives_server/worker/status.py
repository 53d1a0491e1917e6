"""What a worker reports about itself: the WorkerStatus message, GetState, per-op logs.

The counters live in :class:`~collectives_server.worker.stats.WorkerStats`
(re-exported here). :func:`collect_status` builds the ``WorkerStatus`` message
that every heartbeat carries and GetState answers; :func:`worker_state` is the
GetState answer; the metrics endpoint reads the same counters
(``worker/metrics.py``). :func:`op_done` is the per-op hook: it records the op
and logs one line for it (DEBUG; failures WARNING on the leader) with the ids as
log fields. Everything here reads the worker through its
:class:`~collectives_server.worker.context.WorkerContext`.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import socket
import time
from collections.abc import Mapping

import grpc
import torch

import collectives_server
from collectives.errors import CollectiveError
from collectives.v1 import status_pb2, worker_pb2
from collectives.wire.op_specs import kind_name, spec, subject
from collectives_server.control_protocol import FIELD_LIMITS
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.models.batching import BatchingStats
from collectives_server.worker.stats import (
    LATENCY_BUCKETS_S,
    RECENT_ERRORS,
    WorkerStats,
    status_label,
)
from collectives_server.worker.telemetry.collective_traffic import collective_traffic
from collectives_server.worker.telemetry.flight_record import add_flight_summary

__all__ = [
    "LATENCY_BUCKETS_S",
    "MODEL_VERSIONS_BUDGET_BYTES",
    "RECENT_ERRORS",
    "WorkerStats",
    "add_model_versions",
    "backend_version",
    "collect_status",
    "data_op_done",
    "heartbeat_status",
    "memory_status",
    "op_done",
    "status_label",
    "worker_state",
]

log = logging.getLogger(__name__)
# Per-op log lines go to this logger, so operators can raise or lower them alone.
op_log = logging.getLogger("collectives_server.worker.ops")

# WorkerStatus.model_versions takes at most this many encoded bytes (a quarter of
# the heartbeat status's 64 KiB limit): about 60 models of the longest names
# (256 characters), 680 of 16. The rest are counted in model_versions_omitted.
MODEL_VERSIONS_BUDGET_BYTES = 16 * 1024
# Bytes an entry of model_versions adds beyond its own, at most: the field's tag
# (field 21: 2 bytes) and the length prefix (1 or 2 bytes: entries are < 16 KiB).
_ENTRY_OVERHEAD_BYTES = 4

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


def collect_status(ctx: WorkerContext) -> status_pb2.WorkerStatus:
    """The worker's status as heartbeats carry it and GetState answers it."""
    count, nbytes = ctx.store.stats()
    runtime = ctx.runtime
    devices, rss, host_total, host_available = memory_status(ctx.devices)
    msg = status_pb2.WorkerStatus(
        tensors_held=count,
        bytes_held=nbytes,
        queue_depth=runtime.queue_depth if runtime is not None else 0,
        devices=devices,
        package_version=collectives_server.__version__,
        torch_version=torch.__version__,
        backend_version=backend_version(ctx.backend),
        process_rss_bytes=rss,
        host_memory_total_bytes=host_total,
        host_memory_available_bytes=host_available,
    )
    models = ctx.models.all()
    hosted = sorted(((m.name, m.version) for m in models), key=lambda m: m[0])
    msg.models.extend(name for name, _ in hosted)
    batching = {m.name: m.batcher.stats() for m in models if m.batcher is not None}
    add_model_versions(msg, hosted, batching=batching)
    msg.graphs_retained = ctx.models.graphs_retained()
    stats = ctx.stats
    with stats.lock:
        summaries = stats.kind_summaries()
        for kind in sorted(set(stats.ops_completed) | set(stats.ops_failed)):
            recent = summaries.get(kind)
            received, sent = stats.collective_bytes.get(kind, (0, 0))
            msg.ops.add(
                kind=kind,
                completed=stats.ops_completed[kind],
                failed=stats.ops_failed[kind],
                rate_per_s=recent.rate_per_s if recent else 0.0,
                latency_p50_us=_micros(recent.p50_s) if recent else 0,
                latency_p99_us=_micros(recent.p99_s) if recent else 0,
                collective_bytes_received=received,
                collective_bytes_sent=sent,
            )
        msg.error_groups.extend(stats.error_groups.to_proto())
        msg.last_op = stats.last_op
        msg.last_op_latency_s = stats.last_op_latency_s
        msg.bytes_received = stats.bytes_in
        msg.bytes_sent = stats.bytes_out
        msg.recent_errors.extend(stats.recent_errors)
        msg.data_collectives = stats.data_collectives
        msg.gradient_buckets_reduced = stats.gradient_buckets_reduced
    msg.clients.extend(stats.clients.to_proto())
    add_flight_summary(msg, ctx)
    _fit(msg)
    return msg


def _micros(seconds: float) -> int:
    """Seconds as whole microseconds for a uint32 field (at most about 71 minutes)."""
    return min(round(seconds * 1e6), 2**32 - 1)


def _fit(msg: status_pb2.WorkerStatus) -> None:
    """Drops the oldest error groups, then clients, then recent ops, while the status is over the
    heartbeat's limit (the coordinator would refuse the heartbeat)."""
    limit = FIELD_LIMITS["status"]
    while msg.ByteSize() > limit and (msg.error_groups or msg.clients or msg.recent_ops):
        (msg.error_groups or msg.clients or msg.recent_ops).pop()


def add_model_versions(
    msg: status_pb2.WorkerStatus,
    hosted: list[tuple[str, int]],
    budget_bytes: int = MODEL_VERSIONS_BUDGET_BYTES,
    batching: Mapping[str, BatchingStats] | None = None,
) -> None:
    """Fills ``msg.model_versions`` from ``hosted`` ((name, version) in name order) while
    the entries fit in ``budget_bytes`` encoded; counts the rest in
    ``model_versions_omitted``, so a worker hosting many models keeps its status
    under the heartbeat's limit and readers can say how many are not shown.
    ``batching``: the batcher's counts of the models that batch."""
    used = 0
    batching = batching or {}
    for i, (name, version) in enumerate(hosted):
        entry = status_pb2.ModelVersion(name=name, version=version)
        done = batching.get(name)
        if done is not None:
            entry.batches, entry.batched_rows = done.batches, done.rows
        used += entry.ByteSize() + _ENTRY_OVERHEAD_BYTES
        if used > budget_bytes:
            msg.model_versions_omitted = len(hosted) - i
            return
        msg.model_versions.append(entry)


def worker_state(ctx: WorkerContext) -> worker_pb2.GetStateResponse:
    """The GetState answer: identity, place in the generation, status, uptime."""
    runtime = ctx.runtime
    status = collect_status(ctx)
    with ctx.stats.lock:
        completed = sum(ctx.stats.ops_completed.values())
        failed = sum(ctx.stats.ops_failed.values())
    return worker_pb2.GetStateResponse(
        worker_id=ctx.worker_id,
        rank=runtime.rank if runtime else -1,
        generation=runtime.generation if runtime else 0,
        is_leader=bool(runtime and runtime.is_leader),
        queue_depth=runtime.queue_depth if runtime else 0,
        tensors_held=status.tensors_held,
        bytes_held=status.bytes_held,
        ops_completed=completed,
        ops_failed=failed,
        devices=[str(d) for d in ctx.devices],
        backend=ctx.backend,
        status=status,
        address=ctx.address,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        uptime_s=time.monotonic() - ctx.started,
        world_size=runtime.world_size if runtime else 0,
        membership_digest=runtime.membership_digest if runtime else "",
        coordinator=ctx.config.coordinator,
    )


# ------------------------------------------------------------------ the op hook


def _operand_bytes(kind: int, outcome: object, group_size: int) -> int:
    """Bytes of one rank's operand, from the result's dtype and shape (0 if unknown)."""
    dtype, shape = getattr(outcome, "dtype", None), tuple(getattr(outcome, "shape", ()) or ())
    return spec(kind).operand_nbytes(dtype, shape, group_size)


def _group_ranks(ctx: WorkerContext, desc: worker_pb2.OpDescriptor) -> list[int]:
    if desc.WhichOneof("args") == "new_group":
        return list(desc.new_group.ranks)
    runtime = ctx.runtime
    if runtime is None or runtime.generation != desc.generation:
        return []
    group = runtime.groups.get(desc.group_id)
    return list(group.ranks) if group is not None else []


def _count_traffic(
    ctx: WorkerContext,
    desc: worker_pb2.OpDescriptor,
    kind: str,
    outcome: object,
    ranks: list[int],
) -> None:
    """Adds a committed collective's modelled traffic on this rank to the stats."""
    if desc.WhichOneof("args") != "tensor" or len(ranks) < 2:
        return
    runtime = ctx.runtime
    rank = runtime.rank if runtime is not None else -1
    nbytes = _operand_bytes(desc.kind, outcome, len(ranks))
    received, sent = collective_traffic(desc.kind, nbytes, len(ranks), rank == desc.tensor.root)
    ctx.stats.add_collective_bytes(kind, received=received, sent=sent)


def _op_done(
    ctx: WorkerContext,
    desc: worker_pb2.OpDescriptor,
    outcome: object,
    latency_s: float,
) -> None:
    """Counts a finished op and logs it: one DEBUG line, or WARNING for a failure on the leader.

    The fields (``op_id``, ``generation``, ``kind``, ...) are log-record extras, so
    ``--log-format json`` makes them searchable; the text line carries them too.
    """
    failed = isinstance(outcome, CollectiveError)
    code = outcome.code if failed else None
    kind, tensor = kind_name(desc.kind), subject(desc)
    ctx.stats.record(
        kind,
        code,
        latency_s,
        op_id=desc.op_id,
        generation=desc.generation,
        message=outcome.message if failed else "",
    )
    ranks = _group_ranks(ctx, desc)
    if not failed:
        _count_traffic(ctx, desc, kind, outcome, ranks)
    level = logging.DEBUG
    if failed:
        runtime = ctx.runtime
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
    ctx: WorkerContext,
    kind: str,
    name: str,
    code: grpc.StatusCode | None,
    message: str,
    latency_s: float,
) -> None:
    """Counts a data-plane call (put, get, delete) and logs it at DEBUG (failures at INFO)."""
    runtime = ctx.runtime
    generation = runtime.generation if runtime is not None else 0
    ctx.stats.record(kind, code, latency_s, generation=generation, message=message)
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


def heartbeat_status(ctx: WorkerContext) -> status_pb2.WorkerStatus | None:
    """The status for a heartbeat; None (logged) if collecting it failed, so that a bug
    here can never stop the heartbeats that keep the worker in the cluster."""
    try:
        return collect_status(ctx)
    except Exception:
        log.exception("collecting the worker status failed; heartbeat sent without it")
        return None


def op_done(
    ctx: WorkerContext,
    desc: worker_pb2.OpDescriptor,
    outcome: object,
    latency_s: float,
) -> None:
    """Counts a finished collective and logs it (see :func:`_op_done`); never raises,
    because it runs on the generation's thread, which must not die for a statistic."""
    try:
        _op_done(ctx, desc, outcome, latency_s)
    except Exception:
        log.exception("recording op %d (%s) failed", desc.op_id, kind_name(desc.kind))


def data_op_done(
    ctx: WorkerContext,
    kind: str,
    name: str,
    code: grpc.StatusCode | None,
    message: str,
    latency_s: float,
) -> None:
    """Counts a data-plane call and logs it (see :func:`_data_op_done`); never raises."""
    try:
        _data_op_done(ctx, kind, name, code, message, latency_s)
    except Exception:
        log.exception("recording %s %r failed", kind, name)
