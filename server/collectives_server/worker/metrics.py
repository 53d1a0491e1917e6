"""The worker's Prometheus metrics, computed at scrape time from its WorkerContext.

Names are a contract with the Grafana dashboard (``docker/``); see
``docs/design.md`` ("Observability") before renaming anything.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

import collectives_server
from collectives_server.metrics import FunctionCollector, build_info, new_registry
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.models.batching import ROW_BUCKETS
from collectives_server.worker.stats import LATENCY_BUCKETS_S
from collectives_server.worker.status import collect_status
from collectives_server.worker.telemetry.flight_record import PHASE_BUCKETS_S, PhaseHistograms

__all__ = ["worker_registry"]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _phases(ctx: WorkerContext, histograms: PhaseHistograms) -> Iterator[Metric]:
    """The phase durations of the ops this rank finished (its flight recorder's)."""
    family = HistogramMetricFamily(
        "collectives_op_phase_seconds",
        "Time ops spent in each phase on this rank, by kind: queued (on the leader), "
        "announced (until the handler started), running (agreement, data, commit)",
        labels=["kind", "phase"],
    )
    bounds = [repr(b) for b in PHASE_BUCKETS_S] + ["+Inf"]
    for (kind, phase), (counts, total_s) in sorted(histograms.fold(ctx.recorder).items()):
        cumulative, buckets = 0, []
        for bound, n in zip(bounds, counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        family.add_metric([kind, phase], buckets, total_s)
    yield family


def _collect(ctx: WorkerContext, histograms: PhaseHistograms) -> Iterator[Metric]:
    status = collect_status(ctx)
    stats = ctx.stats
    with stats.lock:
        by_status = dict(stats.ops_by_status)
        heartbeats = (stats.heartbeats_sent, stats.heartbeat_failures)
        reissued = stats.ops_reissued
        fused = (stats.fused_runs, stats.fused_ops)
        collective_bytes = {k: tuple(v) for k, v in stats.collective_bytes.items()}
        stragglers = dict(stats.stragglers)
    runtime = ctx.runtime

    yield build_info(collectives_server.__version__, torch.__version__, ctx.backend)
    ops = CounterMetricFamily(
        "collectives_ops", "Ops finished by this worker, by kind and outcome",
        labels=["kind", "status"],
    )  # fmt: skip
    for (kind, label), n in sorted(by_status.items()):
        ops.add_metric([kind, label], n)
    yield ops
    latency = HistogramMetricFamily(
        "collectives_op_latency_seconds", "Op latency on this worker, by kind", labels=["kind"]
    )
    bounds = [repr(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
    for kind, (counts, total_s) in sorted(stats.latency_snapshot().items()):
        cumulative, buckets = 0, []
        for bound, n in zip(bounds, counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        latency.add_metric([kind], buckets, total_s)
    yield latency
    yield from _phases(ctx, histograms)
    straggler = CounterMetricFamily(
        "collectives_op_straggler",
        "Ops the group waited for this rank in: the last rank to reach an op whose "
        "outcome the ranks agreed on (counted by the leader; other workers export 0)",
        labels=["rank"],
    )
    world = range(runtime.world_size) if runtime is not None else range(0)
    for rank in sorted(set(world) | set(stragglers)):
        straggler.add_metric([str(rank)], stragglers.get(rank, 0))
    yield straggler
    moved = CounterMetricFamily(
        "collectives_bytes", "Data-plane payload bytes by direction", labels=["direction"]
    )
    moved.add_metric(["received"], status.bytes_received)
    moved.add_metric(["sent"], status.bytes_sent)
    yield moved
    collective = CounterMetricFamily(
        "collectives_collective_bytes",
        "Collective payload bytes this rank moved, by kind and direction (the "
        "bandwidth-optimal algorithm's traffic for the op's operand size)",
        labels=["kind", "direction"],
    )
    for kind, (received, sent) in sorted(collective_bytes.items()):
        collective.add_metric([kind, "received"], received)
        collective.add_metric([kind, "sent"], sent)
    yield collective
    yield _gauge(
        "collectives_clients_connected",
        "Clients that called this worker in the last 60 s",
        len(status.clients),
    )
    yield _gauge(
        "collectives_error_groups",
        "Distinct failures (kind, code, message) this worker keeps counts of",
        len(status.error_groups),
    )
    yield _counter(
        "collectives_fused_runs", "Announcements that carried several queued small ops", fused[0]
    )
    yield _counter("collectives_fused_ops", "Ops that ran inside a fused announcement", fused[1])
    yield _gauge("collectives_queue_depth", "Ops waiting in the leader's queue", status.queue_depth)
    yield from _connections(ctx)
    yield _counter(
        "collectives_put_buffers_reused",
        "Puts received into memory a replaced value left (no fresh pages to fault in)",
        ctx.replaced.puts_reused,
    )
    yield _counter(
        "collectives_result_buffers_reused",
        "Op results allocated on memory a replaced value left (no fresh pages to fault in)",
        ctx.replaced.results_reused,
    )
    yield _gauge(
        "collectives_replaced_memory_bytes",
        "Memory of replaced values kept for the next put or result of its size "
        "(outside the tensor quota; given back after a few idle seconds)",
        ctx.replaced.held_bytes,
    )
    yield _gauge("collectives_tensors_held", "Named tensors stored", status.tensors_held)
    yield _gauge("collectives_tensors_held_bytes", "Bytes of stored tensors", status.bytes_held)
    used = GaugeMetricFamily(
        "collectives_device_memory_used_bytes",
        "Memory in use (CUDA: whole device; cpu: this process's RSS)",
        labels=["device"],
    )
    total = GaugeMetricFamily(
        "collectives_device_memory_total_bytes",
        "Memory of the device (cpu: the host's)",
        labels=["device"],
    )
    for d in status.devices:
        used.add_metric([d.device], d.memory_used_bytes)
        total.add_metric([d.device], d.memory_total_bytes)
    yield used
    yield total
    yield _gauge(
        "collectives_worker_generation",
        "Generation of this worker's process group (0: none)",
        runtime.generation if runtime is not None else 0,
    )
    yield _gauge(
        "collectives_worker_rank",
        "Rank in the current generation (-1: not a member)",
        runtime.rank if runtime is not None else -1,
    )
    yield _counter("collectives_heartbeats_sent", "Heartbeats answered", heartbeats[0])
    yield _counter("collectives_heartbeat_failures", "Heartbeats that failed", heartbeats[1])
    yield _counter(
        "collectives_ops_reissued",
        "Ops the SDK sent again to this leader after a drain's generation change "
        "(refused there, never run)",
        reissued,
    )
    yield _gauge("collectives_models_loaded", "Models loaded", len(status.models))
    # Every hosted model (the heartbeat's status lists only as many as fit its budget).
    versions = GaugeMetricFamily(
        "collectives_model_version",
        "Version of each hosted model (1 after loading, +1 per committed publish or step)",
        labels=["model"],
    )
    for name, version in sorted((m.name, m.version) for m in ctx.models.all()):
        versions.add_metric([name], version)
    yield versions
    yield from _batching(ctx)
    yield _counter(
        "collectives_data_collectives",
        "Data collectives issued by model operations",
        status.data_collectives,
    )
    yield _counter(
        "collectives_gradient_buckets",
        "Gradient buckets all-reduced",
        status.gradient_buckets_reduced,
    )


def _batching(ctx: WorkerContext) -> Iterator[Metric]:
    """What each batching model's batcher ran (models.batching)."""
    batches = CounterMetricFamily(
        "collectives_forward_batches",
        "Forwards the dynamic batcher ran, each serving one or more callers, by model",
        labels=["model"],
    )
    rows = HistogramMetricFamily(
        "collectives_forward_batch_rows",
        "Rows per forward the dynamic batcher ran, by model",
        labels=["model"],
    )
    bounds = [str(b) for b in ROW_BUCKETS] + ["+Inf"]
    for model in sorted(ctx.models.all(), key=lambda m: m.name):
        if model.batcher is None:
            continue
        done = model.batcher.stats()
        batches.add_metric([model.name], done.batches)
        cumulative, buckets = 0, []
        for bound, n in zip(bounds, done.row_counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        rows.add_metric([model.name], buckets, done.rows)
    yield batches
    yield rows
    routed = CounterMetricFamily(
        "collectives_routed_forwards",
        "Forwards a client placed on this worker by load (a request too small to split "
        "across the workers), by model",
        labels=["model"],
    )
    for model, count in sorted(ctx.forwards.routed().items()):
        routed.add_metric([model], count)
    yield routed
    yield _gauge(
        "collectives_forwards_in_flight",
        "Forwards running or queued on this worker now (what clients place small requests by)",
        ctx.forwards.in_flight,
    )


def _connections(ctx: WorkerContext) -> Iterator[Metric]:
    """What clients hold open on the data plane: the counts the data-plane caps bound."""
    if ctx.data_streams is not None:
        yield _gauge(
            "collectives_data_streams_active",
            "Data-plane calls in progress (put/get/bulk/shm/forward; --max-data-streams)",
            ctx.data_streams.active,
        )
    if ctx.bulk is not None:
        yield _gauge(
            "collectives_bulk_connections_open",
            "Bulk-port connections being served (--max-bulk-connections)",
            ctx.bulk.open_connections,
        )
        yield _counter(
            "collectives_bulk_connections_refused",
            "Bulk-port connections closed at once for a connection cap",
            ctx.bulk.refused_connections,
        )
        lanes = ctx.bulk.lanes
        if lanes is not None:
            calls = CounterMetricFamily(
                "collectives_call_lane_calls",
                "Calls answered on call lanes (over kept bulk-port connections, not a "
                "gRPC call each), by Worker method",
                labels=["method"],
            )
            for method in filter(None, lanes.methods):
                calls.add_metric([method], lanes.calls.get(method, 0))
            yield calls


def worker_registry(ctx: WorkerContext) -> CollectorRegistry:
    """A registry (of its own) serving the worker's metrics."""
    registry = new_registry()
    histograms = PhaseHistograms()
    registry.register(FunctionCollector(lambda: _collect(ctx, histograms)))
    return registry
