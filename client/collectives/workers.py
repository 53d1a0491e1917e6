"""The cluster-state values under the module name they had before the protocol package.

``ClusterSnapshot`` (what ``Cluster.snapshot()`` returns), ``GenerationRecord``
(``Cluster.history()``), ``WorkerInfo``, ``ClusterNotFormed`` and their parts
live in :mod:`collectives.wire.cluster_state`, which the SDK and the daemons
share; code that imports them from ``collectives.workers`` keeps working.
"""

from __future__ import annotations

from collectives.wire.cluster_state import (
    DEFAULT_OP_TIMEOUT_S,
    ClusterNotFormed,
    ClusterSnapshot,
    DeviceMemory,
    GenerationRecord,
    OpCount,
    RecentError,
    WorkerInfo,
    WorkerState,
    check_rank,
)

__all__ = [
    "DEFAULT_OP_TIMEOUT_S",
    "ClusterNotFormed",
    "ClusterSnapshot",
    "DeviceMemory",
    "GenerationRecord",
    "OpCount",
    "RecentError",
    "WorkerInfo",
    "WorkerState",
    "check_rank",
]
