"""What a worker's RPC handlers, status, metrics and shm transfers read: one WorkerContext.

The daemon (``worker/daemon.py``) builds one :class:`WorkerContext` and hands
it to the servicer (``service.py`` and its parts), the RPC guards,
the status and GetState code (``status.py``), the metrics registry
(``metrics.py``) and the shared-memory handlers (``shm_service.py``). None of
those import the daemon; this module imports none of them (nor the generation, nor
torch.distributed, nor a gRPC server), so there is no import cycle.

The long-lived pieces (store, models, counters, uploads, shm segments) are
built once. The daemon keeps the rest current: ``port``, ``address`` and
``bulk`` once its servers are up, ``worker_id`` and ``op_timeout_s`` on
registration, and ``runtime``, ``cluster_status`` and ``leader_address`` under
its lock as generations come and go. Readers take ``runtime`` once per call
(``runtime = ctx.runtime``) and use that snapshot: it may be replaced, or set to
None, at any moment.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from collectives_server.rpc.limits import StreamSlots
from collectives_server.worker.config import WorkerConfig
from collectives_server.worker.data.replaced_memory import ReplacedMemory
from collectives_server.worker.data.shm_segments import WorkerSegments
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.engine.flight_recorder import FlightRecorder
from collectives_server.worker.models.archive.upload import ModelUploads
from collectives_server.worker.models.built_ahead import ModulesBuiltAhead
from collectives_server.worker.models.registry import ModelRegistry
from collectives_server.worker.stats import WorkerStats
from collectives_server.worker.telemetry.forward_load import ForwardLoad
from collectives_server.worker.transport.bulk import BulkListener
from collectives_server.worker.transport.handoff import HandoffSource

__all__ = ["GenerationView", "WorkerContext"]


class GenerationView(Protocol):
    """What status, metrics and GetState read of the current generation.

    ``Generation`` (``worker/engine/generation.py``) satisfies it; the servicer's
    ``rpc/leader.py`` uses its full interface.
    """

    @property
    def generation(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def busy(self) -> bool: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def groups(self) -> Mapping[int, Any]: ...


@dataclass(eq=False)
class WorkerContext:
    """One worker's shared state, as its RPC handlers and reports see it."""

    config: WorkerConfig
    devices: list[torch.device]
    backend: str  # "nccl" or "gloo"
    store: TensorStore
    models: ModelRegistry
    uploads: ModelUploads
    shm_segments: WorkerSegments
    stats: WorkerStats
    # Memory of replaced values, reused by the next put or op result of its size
    # (replaced_memory.py).
    replaced: ReplacedMemory
    # The collective timeout: --op-timeout-s, else the coordinator's (on registration).
    op_timeout_s: float
    # Every op this worker ran, with its phase times (--flight-recorder-ops).
    recorder: FlightRecorder = field(default_factory=FlightRecorder)
    # Forwards running or queued now, and the ones clients placed here by load.
    forwards: ForwardLoad = field(default_factory=ForwardLoad)
    # What this worker offers its successor while it is being drained (handoff.py).
    handoff: HandoffSource = field(default_factory=HandoffSource)
    # As a drain's successor: the drained rank's gradients by model and parameter, set
    # once each model is hosted here (engine.model_sync takes them).
    handoff_gradients: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # As a drain's successor: the models' modules built while the drain prepared.
    built_ahead: ModulesBuiltAhead = field(default_factory=ModulesBuiltAhead)
    # The bulk data plane; None without one (TLS, or --no-bulk) and before start.
    bulk: BulkListener | None = None
    # The data-plane calls in progress (--max-data-streams); None before start.
    data_streams: StreamSlots | None = None
    # The port the gRPC server is bound to (0 before it starts) and the address
    # peers and clients use.
    port: int = 0
    address: str = ""
    worker_id: str = ""
    # The current generation (None: not a member of a formed cluster).
    runtime: GenerationView | None = None
    cluster_status: str = "not registered yet"
    leader_address: str = ""
    started: float = field(default_factory=time.monotonic)

    @property
    def device(self) -> torch.device:
        """The device the tensor store and the process group use."""
        return self.devices[0]
