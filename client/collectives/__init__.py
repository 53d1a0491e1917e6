"""collectives: torch.distributed collectives as a service.

``collectives.connect("host:port")`` returns a :class:`Cluster` whose methods
place named tensors on the workers (``put``/``get``/``scatter``/``delete``) and
run collectives on them (``broadcast``, ``all_reduce``, ``reduce``,
``all_gather``, ``gather``, ``reduce_scatter``, ``all_to_all``, ``barrier``,
``new_group``, ``destroy_group``) and move them point to point (``send``,
``exchange``); ``cluster.data_parallel(name)`` returns a :class:`DataParallel`.
Failures raise :class:`CollectiveError` subclasses carrying the gRPC status
code and the server's message.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from collectives.errors import (
    CollectiveError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

if TYPE_CHECKING:
    from collectives.cluster import Cluster, connect
    from collectives.data_parallel import DataParallel
    from collectives.flight_record import OpRecord, RankPhases
    from collectives.groups import Group
    from collectives.reduce_ops import ReduceOp
    from collectives.wire.batching import Batching
    from collectives.wire.cluster_state import DrainReport, WorkerInfo, WorkerState
    from collectives.work import Work

# Imported on first use (PEP 562): they need torch, whose import is slow, and
# tools that only need the generated stubs (the daemons' --help, `collectives
# status`) should not pay for it.
_LAZY = {
    "Batching": "collectives.wire.batching",
    "Cluster": "collectives.cluster",
    "connect": "collectives.cluster",
    "DataParallel": "collectives.data_parallel",
    "DrainReport": "collectives.wire.cluster_state",
    "Group": "collectives.groups",
    "OpRecord": "collectives.flight_record",
    "RankPhases": "collectives.flight_record",
    "ReduceOp": "collectives.reduce_ops",
    "Work": "collectives.work",
    "WorkerInfo": "collectives.wire.cluster_state",
    "WorkerState": "collectives.wire.cluster_state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "Batching",
    "Cluster",
    "CollectiveError",
    "DataParallel",
    "DeadlineExceeded",
    "DrainReport",
    "FailedPrecondition",
    "Group",
    "InvalidArgument",
    "NotFound",
    "OpRecord",
    "PermissionDenied",
    "RankPhases",
    "ReduceOp",
    "ResourceExhausted",
    "Unavailable",
    "Work",
    "WorkerInfo",
    "WorkerState",
    "__version__",
    "connect",
]
