"""What the model helpers need of a cluster connection, declared once.

``publish`` (``_publish``) and ``DataParallel`` (``data_parallel``) run on a
connection that ``Cluster`` is; they are imported by ``_models``, which builds
the model half of ``Cluster``, so they name what they use through this
``Protocol`` instead of importing ``_models`` back (no import cycle, also not
under ``TYPE_CHECKING``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from collectives._transport import WorkerEndpoint
from collectives.errors import CollectiveError
from collectives.wire.cluster_state import ClusterSnapshot

__all__ = ["ModelSession"]

R = TypeVar("R")


class ModelSession(Protocol):
    """A connection to a cluster, as the model helpers use it (``Cluster`` is one)."""

    _progress: bool | None

    def _deadline(self, timeout: float | None) -> float: ...

    def _formed_snapshot(self, deadline: float) -> ClusterSnapshot: ...

    def _leader_snapshot(self, deadline: float) -> ClusterSnapshot: ...

    def _endpoint(self, address: str) -> WorkerEndpoint: ...

    def _retry(
        self,
        what: str,
        deadline: float,
        attempt: Callable[[float], R],
        retryable: Callable[[CollectiveError], bool],
    ) -> R: ...

    def _fan_out(self, what: str, fns: dict[int, Callable[[], R]]) -> dict[int, R]: ...

    def _release_graph(self, model: str, call_id: str, endpoints: list[WorkerEndpoint]) -> None: ...

    def _note_remote_backward(self, name: str) -> None: ...

    def models(self, timeout: float | None = None) -> list[Any]: ...

    def set_model_mode(
        self, name: str, training: bool = True, timeout: float | None = None
    ) -> Any: ...
