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

__all__ = ["cluster_to_dict", "cluster_to_json"]


def cluster_to_dict(cluster: coordinator_pb2.Cluster) -> dict[str, Any]:
    """The Cluster as ``status --json`` shows it (without ``"coordinator"``)."""
    return ClusterSnapshot.from_proto(cluster).to_dict()


def cluster_to_json(cluster: coordinator_pb2.Cluster) -> str:
    """:func:`cluster_to_dict` as compact JSON."""
    return json.dumps(cluster_to_dict(cluster), separators=(",", ":"))
