"""The dashboard's JSON: one schema with ``collectives status --json``.

``/api/cluster`` and the data of every ``/api/events`` event are
``collectives.wire.cluster_state.ClusterSnapshot.from_proto(msg).to_dict()``: the same
field names, plain JSON integers (not the proto3 mapping's strings for 64-bit
fields), worker states as ``"ready"``, ``"lost"``..., and the derived
``ops_completed`` / ``ops_failed`` per worker. ``status --json`` prints the same
dict with a ``"coordinator"`` key (the address it asked) in front; the dashboard
serves the coordinator it is part of, so it has no such key.
"""

from __future__ import annotations

import json
from typing import Any

from collectives.v1 import coordinator_pb2
from collectives.wire.cluster_state import ClusterSnapshot

__all__ = ["WITHHELD", "cluster_to_dict", "cluster_to_json", "without_details"]

# What stands in for a withheld message on a token cluster's dashboard.
WITHHELD = "(details need the cluster's token: collectives status / diagnose)"


def cluster_to_dict(cluster: coordinator_pb2.Cluster) -> dict[str, Any]:
    """The Cluster as ``status --json`` shows it (without ``"coordinator"``)."""
    return ClusterSnapshot.from_proto(cluster).to_dict()


def cluster_to_json(cluster: coordinator_pb2.Cluster) -> str:
    """:func:`cluster_to_dict` as compact JSON."""
    return json.dumps(cluster_to_dict(cluster), separators=(",", ":"))


def without_details(cluster: coordinator_pb2.Cluster) -> coordinator_pb2.Cluster:
    """A copy of ``cluster`` for viewers without the cluster's token: each worker's
    ops, errors and state keep their kinds, codes, counts and times, and lose the
    names, clients, call ids and messages in them."""
    shown = coordinator_pb2.Cluster()
    shown.CopyFrom(cluster)
    for worker in shown.workers:
        status = worker.status
        del status.clients[:]
        if status.stuck:
            status.stuck = f"an op is in flight too long {WITHHELD}"
        for op in status.recent_ops:
            del op.names[:]
            op.client = op.call_id = ""
            if op.message:
                op.message = WITHHELD
        for error in status.recent_errors:
            error.message = WITHHELD
        for group in status.error_groups:
            group.message = WITHHELD
            group.client = ""
    return shown
