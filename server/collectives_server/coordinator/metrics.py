"""The coordinator's Prometheus metrics, computed at scrape time from the membership.

Names are a contract with the Grafana dashboard (``docker/``); see
``docs/design.md`` ("Observability") before renaming anything.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

import collectives_server
from collectives_server.coordinator.vocabulary import ClusterView, WorkerState
from collectives_server.metrics import FunctionCollector, build_info, new_registry

if TYPE_CHECKING:
    from collectives_server.coordinator.dashboard.server import DashboardServer
    from collectives_server.coordinator.service import CoordinatorServicer

__all__ = ["MEMBERSHIP_REASONS", "coordinator_registry"]

MEMBERSHIP_REASONS = ("joined", "lost", "left")


@functools.cache
def _torch_version() -> str:
    """torch's version from its package metadata: a coordinator that hosts no
    rendezvous store never imports torch (hundreds of MB resident)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _collect(servicer: CoordinatorServicer) -> Iterator[Metric]:
    view, events, heartbeats = servicer.metrics_snapshot()
    yield build_info(collectives_server.__version__, _torch_version(), "none")
    yield GaugeMetricFamily(
        "collectives_coordinator_leader",
        "1 on the coordinator that decides membership (always, with the memory store); "
        "0 on a standby of an HA set on etcd",
        value=1 if servicer.is_leader else 0,
    )
    yield GaugeMetricFamily(
        "collectives_generation", "Current generation (0: none sealed yet)", value=view.generation
    )
    yield GaugeMetricFamily(
        "collectives_world_size", "Members of the current generation", value=view.world_size
    )
    yield GaugeMetricFamily(
        "collectives_cluster_formed",
        "1 while a generation is sealed with enough live members",
        value=1 if view.formed else 0,
    )
    workers = GaugeMetricFamily(
        "collectives_workers", "Registered workers by state", labels=["state"]
    )
    for state in WorkerState:
        workers.add_metric([state.value], sum(1 for w in view.workers if w.state is state))
    yield workers
    changes = CounterMetricFamily(
        "collectives_membership_changes",
        "Workers that joined (registered), were lost (lease ran out) or left",
        labels=["reason"],
    )
    for reason in MEMBERSHIP_REASONS:
        changes.add_metric([reason], events.get(reason, 0))
    yield changes
    yield CounterMetricFamily(
        "collectives_coordinator_pauses",
        "Pauses of this coordinator's own (stopped, starved, frozen by its host) after "
        "which every worker's lease started again instead of running out",
        value=events.get("coordinator_pauses", 0),
    )
    yield CounterMetricFamily(
        "collectives_heartbeats_received",
        "Heartbeats received (unary calls and messages on heartbeat streams)",
        value=heartbeats,
    )
    yield GaugeMetricFamily(
        "collectives_heartbeat_streams",
        "Open HeartbeatStream calls (workers heartbeating on a stream, not unary calls)",
        value=servicer.heartbeat_streams,
    )
    age = GaugeMetricFamily(
        "collectives_worker_heartbeat_age_seconds",
        "Seconds since each listed worker's last heartbeat",
        labels=["worker"],
    )
    for w in view.workers:
        age.add_metric([w.address], w.last_heartbeat_age_s)
    yield age
    yield from _drains(view, events)
    yield from _control(servicer)


def _drains(view: ClusterView, events: dict[str, int]) -> Iterator[Metric]:
    """Drains: how many ended and how, the bytes handed over, the one in progress."""
    drains = CounterMetricFamily(
        "collectives_drains",
        "Drains that ended: completed (the rank handed over) or failed (called off)",
        labels=["outcome"],
    )
    drains.add_metric(["completed"], view.drains_completed)
    drains.add_metric(["failed"], events.get("drains_failed", 0))
    yield drains
    yield CounterMetricFamily(
        "collectives_drain_bytes",
        "Tensor bytes drains handed over, worker to worker",
        value=view.drain_bytes_total,
    )
    h = view.handoff
    yield GaugeMetricFamily(
        "collectives_drain_in_progress", "1 while a drain hands a rank over", value=int(bool(h))
    )
    yield GaugeMetricFamily(
        "collectives_drain_bytes_copied",
        "Bytes the successor of the drain in progress has copied (of its drain's total)",
        value=h.bytes_copied if h is not None else 0,
    )
    done = [r for r in view.drains if not r.error]
    yield GaugeMetricFamily(
        "collectives_drain_last_seconds",
        "How long the last completed drain's handoff took",
        value=done[-1].seconds if done else 0.0,
    )


def _control(servicer: CoordinatorServicer) -> Iterator[Metric]:
    """Refusals of the coordinator's guard, watch streams, Cluster size."""
    guard = servicer.guard
    refused = CounterMetricFamily(
        "collectives_coordinator_refused",
        "Coordinator calls refused by its guard, by reason (permission_denied, "
        "already_exists, invalid_argument, resource_exhausted, status_over_budget)",
        labels=["reason"],
    )
    for reason, count in sorted(guard.refused().items()):
        refused.add_metric([reason], count)
    yield refused
    yield GaugeMetricFamily(
        "collectives_watch_streams", "Open WatchCluster streams", value=guard.watch_streams
    )
    yield GaugeMetricFamily(
        "collectives_cluster_message_bytes",
        "Estimated encoded size of the Cluster message (its budget is 3.9 MB)",
        value=guard.budget.estimate,
    )


def _dashboard(dashboard: DashboardServer) -> Iterator[Metric]:
    """The dashboard's connections: the count its cap bounds."""
    yield GaugeMetricFamily(
        "collectives_dashboard_connections_open",
        "Dashboard connections being served (--dashboard-max-connections)",
        value=dashboard.open_connections,
    )
    yield CounterMetricFamily(
        "collectives_dashboard_connections_refused",
        "Dashboard connections answered 503 and closed for the connection cap",
        value=dashboard.refused_connections,
    )


def coordinator_registry(
    servicer: CoordinatorServicer, dashboard: DashboardServer | None = None
) -> CollectorRegistry:
    """A registry (of its own) serving the coordinator's metrics (and its dashboard's)."""
    registry = new_registry()
    registry.register(FunctionCollector(lambda: _collect(servicer)))
    if dashboard is not None:
        registry.register(FunctionCollector(lambda: _dashboard(dashboard)))
    return registry
