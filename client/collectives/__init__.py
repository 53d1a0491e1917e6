"""collectives: torch.distributed collectives as a service.

``collectives.connect("host:port")`` returns a :class:`Cluster` whose methods
place named tensors on the workers (``put``/``get``/``scatter``/``delete``) and
run collectives on them (``broadcast``, ``all_reduce``, ``reduce``,
``all_gather``, ``gather``, ``reduce_scatter``, ``all_to_all``, ``barrier``,
``new_group``). Failures raise :class:`CollectiveError` subclasses carrying the
gRPC status code and the server's message.
"""

from collectives.cluster import Cluster, connect
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
from collectives.groups import Group
from collectives.reduce_ops import ReduceOp
from collectives.work import Work
from collectives.workers import WorkerInfo, WorkerState

__version__ = "0.1.0"

__all__ = [
    "Cluster",
    "CollectiveError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Group",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ReduceOp",
    "ResourceExhausted",
    "Unavailable",
    "Work",
    "WorkerInfo",
    "WorkerState",
    "__version__",
    "connect",
]
