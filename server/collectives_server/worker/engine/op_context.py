"""What an op handler sees of its rank and generation, and what it returns.

Handlers (``worker/handlers``) are functions ``(ctx, desc, announcement) ->
result | error``. :class:`OpContext` gives them this rank's place in the
generation (rank, world, groups), its stores (tensors, models) and the few
services the generation loop provides: running a group call so that a
transport failure becomes :class:`GroupBroken`, counting data collectives,
wording a failure every rank agreed on. Nothing here knows about gRPC servers
or the daemon; a test builds one over a fake process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from collectives.errors import CollectiveError, error_for_code
from collectives_server.worker.data.replaced_memory import ReplacedMemory
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.engine.agreement import RankOutcome
from collectives_server.worker.engine.control_channel import ControlChannel
from collectives_server.worker.engine.descriptor import Announced
from collectives_server.worker.engine.process_groups import GroupHandles
from collectives_server.worker.kernels import op_failures
from collectives_server.worker.models.registry import ModelRegistry

__all__ = ["OpContext", "GroupEntry", "GroupBroken", "OpResult", "Announcement"]


class GroupBroken(Exception):
    """The process group failed (peer lost, timeout): the generation cannot go on."""


@dataclass
class GroupEntry:
    group_id: int
    ranks: list[int]  # global ranks, ascending
    handles: GroupHandles | None  # None on non-members

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


@dataclass(frozen=True)
class OpResult:
    op_id: int
    generation: int
    result_name: str
    result_ranks: list[int]
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    latency_s: float


@dataclass
class Announcement:
    """How the op reached this rank: the inline capacity the leader chose (None: no
    operand bytes in the exchange) and, on the leader, its still-pending broadcasts."""

    inline: int | None = None
    pending: Announced | None = None

    def wait(self, ctx: OpContext) -> None:
        """Waits for the leader's own broadcast before a handler relies on delivery."""
        if self.pending is not None:
            ctx.call(self.pending.wait)
            self.pending = None


@dataclass
class OpContext:
    generation: int
    rank: int
    world_size: int
    device: torch.device
    host: str | None
    timeout_s: float
    tcp_store: dist.Store
    prefix: str  # the process group's store prefix (this generation and epoch)
    store: TensorStore
    models: ModelRegistry
    groups: dict[int, GroupEntry]
    control: dist.ProcessGroup | ControlChannel  # announcements, exchanges, agreement
    # The worker's memory of replaced values: results are allocated from it and the
    # values they replace are offered to it (replaced_memory.py).
    spares: ReplacedMemory = field(default_factory=ReplacedMemory)
    max_groups: int = 64
    on_data_collectives: Callable[[int, int], None] | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def operand(self, name: str) -> torch.Tensor | None:
        """This rank's stored ``name`` as an op reads it (None if absent): with any lazy
        conjugate or negation resolved, so its bytes are its values. ``peek``: the
        executor never waits on a commit fence."""
        t = self.store.peek(name)
        if t is not None and (t.is_conj() or t.is_neg()):
            t = t.resolve_conj().resolve_neg()
        return t

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs a group operation; a backend failure means the group is broken."""
        try:
            return fn(*args)
        except (RuntimeError, dist.DistError) as exc:
            raise GroupBroken(op_failures.backend_message(exc)) from exc

    def count_data_collectives(self, collectives: int, gradient_buckets: int = 0) -> None:
        if self.on_data_collectives is not None:
            self.on_data_collectives(collectives, gradient_buckets)

    def fail_all(self, failures: list[RankOutcome]) -> CollectiveError:
        """The error every rank reports when some ranks' outcomes failed."""
        first = failures[0]
        ranks = ", ".join(str(f.rank) for f in failures)
        return error_for_code(
            first.code,
            f"failed on rank(s) {ranks}: {first.message}",
            ranks=tuple(f.rank for f in failures),
            reason=first.reason,
        )
