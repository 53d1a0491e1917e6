"""What an op handler sees of its rank and generation, and what it returns.

Handlers (``worker/handlers``) are functions ``(ctx, desc, announcement) ->
result | error``. :class:`OpContext` gives them this rank's place in the
generation (rank, world, groups), its stores (tensors, models) and the few
services the generation loop provides: running a group call so that a
transport failure becomes :class:`GroupBroken`, counting data collectives,
wording a failure every rank agreed on.

It also holds the engine's invariant, :meth:`OpContext.agree_and_commit`:
every rank returns the same outcome for an op, and a rank commits its results
only once every rank agreed the op succeeded. Handlers end with it instead of
writing the store themselves. Nothing here knows about gRPC servers or the
daemon; a test builds one over a fake process group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
import torch.distributed as dist

from collectives.errors import CollectiveError, error_for_code
from collectives_server.worker.data.replaced_memory import ReplacedMemory
from collectives_server.worker.data.store import TensorStore, WriteWatch
from collectives_server.worker.engine import agreement
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
            ctx.call_alone(self.pending.wait)
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
    replaced: ReplacedMemory = field(default_factory=ReplacedMemory)
    max_groups: int = 64
    on_data_collectives: Callable[[int, int], None] | None = None
    # The leader is told which rank each agreed op waited for (the straggler);
    # op_started: when this rank's handler of the current op began (monotonic);
    # synced_at: when its first exchange with the other ranks returned (0: not yet).
    on_straggler: Callable[[int], None] | None = None
    op_started: float = 0.0
    synced_at: float = 0.0
    op_ranks: list[int] | None = None  # the current op's group (None: every rank)
    # The names the current op (or fused run) reads and writes, and which of them a
    # client wrote since it began (begin_op): a result goes under such a name only if
    # none did, for a put or delete there since is later in the order, and stands.
    writes: WriteWatch | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def begin_op(self) -> None:
        """A new op (or fused run) begins on this rank: a new watch of client writes."""
        if self.writes is not None:
            self.store.unwatch(self.writes)
        self.writes = self.store.watch()

    def end_ops(self) -> None:
        """This executor runs no more ops (its generation ended)."""
        if self.writes is not None:
            self.store.unwatch(self.writes)
            self.writes = None

    def expect(self, targets: Iterable[str], read: Iterable[str] = ()) -> None:
        """Watches from now on the names the op writes (see :attr:`writes`), before it
        reads anything; a name it also ``read``s is watched from that read on
        (:meth:`operand`), so that a put just before the read counts as earlier."""
        if self.writes is None:
            return
        skipped = set(read)
        for target in targets:
            if target not in skipped:
                self.store.watch_name(self.writes, target)

    def operand(self, name: str) -> torch.Tensor | None:
        """This rank's stored ``name`` as an op reads it (None if absent): with any lazy
        conjugate or negation resolved, so its bytes are its values. ``peek``: the
        executor never waits on a commit fence."""
        t = self.store.peek(name, self.writes)  # watched from this read on
        if t is not None and (t.is_conj() or t.is_neg()):
            t = t.resolve_conj().resolve_neg()
        return t

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs a group operation that every rank takes part in; a backend failure means
        the group is broken. The first one of an op to return marks ``synced_at``."""
        result = self.call_alone(fn, *args)
        if self.op_started and not self.synced_at:
            self.synced_at = time.monotonic()
        return result

    def call_alone(self, fn: Callable[..., Any], *args: Any) -> Any:
        """:meth:`call` for a step this rank may finish without the others (the leader's
        wait for its own announcement to be sent): no mark of ``synced_at``."""
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

    def agree(
        self, code: grpc.StatusCode, message: str = "", reason: str | None = None
    ) -> CollectiveError | None:
        """Exchanges this rank's outcome of the op with every rank's: the error every
        rank returns when some failed, None when all succeeded.

        Each rank adds how long it was in the op's handler before its first exchange
        with the others returned (or until now, if this is the first): the rank that
        spent least arrived last, the others waited for it. Measured to the first
        exchange, not to this one, so that work after it, which a loaded machine
        may stretch on one rank, does not count. The leader tells ``on_straggler``
        (the ``collectives_op_straggler_total`` counter)."""
        if not self.op_started:  # outside a handler (every rank alike)
            failures = self.call(
                agreement.agree, self.control, self.world_size, code, message, reason
            )
        else:
            member = self.op_ranks is None or self.rank in self.op_ranks
            arrived_by = self.synced_at or time.monotonic()
            spent = [arrived_by - self.op_started if member else -1.0]
            failures, extras = self.call(
                agreement.agree_with, self.control, self.world_size, code, message, spent, reason
            )
            members = [r for r in range(len(extras)) if extras[r][0] >= 0]
            if self.on_straggler is not None and len(members) > 1:
                self.on_straggler(min(members, key=lambda r: extras[r][0]))
        return self.fail_all(failures) if failures else None

    def agree_and_commit(
        self,
        code: grpc.StatusCode,
        message: str,
        results: dict[str, torch.Tensor | None],
        reason: str | None = None,
        op_id: int = 0,
    ) -> CollectiveError | None:
        """The engine's invariant: :meth:`agree` on the op's outcome, then, only when
        every rank succeeded, store this rank's ``results`` (target name -> value;
        None: nothing to store here). Returns the agreed error, or None once committed.

        The commit happens even if the generation is being retired right now, so a
        success reported anywhere is true everywhere; and it never re-checks quota
        (judged for every rank before the data moved), so a put racing in since cannot
        make one rank skip a commit the others make. Each value a result replaces is
        offered to :attr:`replaced`, which keeps its memory for the next result when
        nothing else holds it: callers drop their own references to their operands
        before calling this."""
        error = self.agree(code, message, reason)
        if error is None:
            self.commit(results, op_id)
        return error

    def commit(self, results: dict[str, torch.Tensor | None], op_id: int = 0) -> None:
        """The commit half of :meth:`agree_and_commit`, alone: only for an outcome every
        rank already shares without an agreement (an inline op's result is a pure
        function of the operands every rank received in the same exchange). ``op_id``:
        the op's, so that a read-back of its result can check it is still there."""
        op = (self.generation, op_id) if op_id else None
        for target, result in results.items():
            if result is not None:
                old = self.store.replace(target, result, watch=self.writes, op=op)
                if old is not None:
                    self.replaced.offer(old)
                del old
