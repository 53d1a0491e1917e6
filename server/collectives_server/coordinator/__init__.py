"""The coordinator: membership rules (:mod:`.membership`), gRPC servicer, daemon."""

from collectives_server.coordinator.daemon import (
    Coordinator,
    CoordinatorConfig,
    format_address,
    run_coordinator,
)
from collectives_server.coordinator.membership import Membership
from collectives_server.coordinator.model import ClusterView, Outcome, WorkerState, WorkerView

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
