"""The coordinator: membership rules (:mod:`.membership`), gRPC servicer, daemon.

Modules:

* ``admission``: who may call the coordinator's worker-only RPCs, and for which worker
* ``cluster_message``: the Cluster message, built from a membership snapshot (and the status key
  heartbeats use)
* ``control``: the coordinator's guard: roles, lease secrets, size limits and stream caps, in one
  place
* ``crash_probe``: whether a worker's process is gone, asked when its heartbeat stream closes
* ``daemon``: the coordinator daemon: gRPC server, rendezvous TCPStore and lease ticker in one
  object
* ``dashboard/``: the coordinator's web dashboard
* ``ha/``: coordinators in an HA set on etcd: one leader decides, standbys follow
* ``membership``: membership and generations of a cluster, as pure decisions
* ``drain_rules``: the membership's drains: a rank handed to a spare, and how a handoff ends
* ``metrics``: the coordinator's Prometheus metrics, computed at scrape time from the membership
* ``registration``: size limits on what a worker may store in the coordinator, checked before
  anything is stored
* ``service``: the ``collectives.v1.Coordinator`` gRPC servicer: protobuf in, membership calls,
  protobuf out
* ``vocabulary``: the coordinator's domain types: worker rows, snapshots, sealed generations,
  outcomes and errors
* ``worker_records``: what the coordinator keeps per worker, and the small pure pieces of the
  membership decision that do not need the whole registry: a worker's row in the Cluster message,
  the lease heap, the status text and registration checks (``membership.py`` holds the decisions
  themselves)
"""

from collectives_server.coordinator.daemon import (
    Coordinator,
    CoordinatorConfig,
    format_address,
    run_coordinator,
)
from collectives_server.coordinator.membership import Membership
from collectives_server.coordinator.vocabulary import ClusterView, Outcome, WorkerState, WorkerView

__all__ = [
    "ClusterView",
    "Coordinator",
    "CoordinatorConfig",
    "Membership",
    "Outcome",
    "WorkerState",
    "WorkerView",
    "format_address",
    "run_coordinator",
]
