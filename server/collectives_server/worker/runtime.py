"""One generation's execution engine on one worker.

The leader (rank 0) owns a bounded FIFO of ops. One thread per rank runs the
generation: on the leader it takes the next op (or, when idle, a no-op tick
that keeps followers inside their receive timeout and proves the group alive),
announces it through the control group, and executes it; on followers it
receives descriptors and executes them. Every rank executes the same op in
the same order, which is what torch.distributed requires and what concurrent
clients could never guarantee by themselves.

Executing one op on every rank (the leader answers once it has committed):
  1. the leader announces the op (descriptor broadcast);
  2. every rank all-gathers its operand description and store quota state,
     and, when the leader saw a small operand (<= ``INLINE_MAX_BYTES``), the
     operand's bytes with it;
  3. :func:`validation.decide`, identical everywhere: fail together (missing,
     mismatched or over-quota anywhere), or go on;
  4. small operands: every rank computes its result from the exchanged bytes
     (:func:`collective_ops.inline_result`) and commits: two control rounds
     per op in all;
     otherwise: the data collective on private buffers, an agreement on every
     rank's outcome, and a commit only if every rank succeeded.
A follower fences the name its result goes to before its last exchange of the
op and lifts the fence once committed (``store.Fence``), so a client reading
any rank right after the leader answered sees the result; no barrier per op.

A generation that is superseded never commits again; its thread is left to
finish or time out (gloo cannot interrupt a pending op) while the next
generation runs beside it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from collectives.errors import CollectiveError, ResourceExhausted, Unavailable, error_for_code
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives_server.worker import (
    agreement,
    collective_ops,
    descriptor,
    model_collectives,
    op_failures,
    validation,
)
from collectives_server.worker.group_cap import check_group_cap, subgroup_count
from collectives_server.worker.models import ModelRegistry
from collectives_server.worker.process_groups import GroupHandles, build_groups
from collectives_server.worker.store import Fence, TensorStore

__all__ = ["GenerationRuntime", "PendingOp", "OpResult", "GroupEntry", "INLINE_MAX_BYTES"]

log = logging.getLogger(__name__)

# Operands up to this size (per rank, and world x this in all) travel inside the
# operand exchange instead of a data collective of their own.
INLINE_MAX_BYTES = 64 * 1024
INLINE_MAX_TOTAL_BYTES = 1024 * 1024
_INLINE_KINDS = frozenset(validation.KINDS) - {"barrier"}


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
class PendingOp:
    desc: worker_pb2.OpDescriptor
    future: Future = field(default_factory=Future)
    started: bool = False
    cancelled: bool = False


@dataclass
class GroupEntry:
    group_id: int
    ranks: list[int]
    handles: GroupHandles | None  # None on non-members

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


def _backend_message(exc: BaseException) -> str:
    return op_failures.backend_message(exc)


class _GroupBroken(Exception):
    """The process group failed (peer lost, timeout): the generation cannot go on."""


class GenerationRuntime:
    def __init__(
        self,
        *,
        generation: int,
        rank: int,
        world_size: int,
        tcp_store: dist.Store,
        store: TensorStore,
        op_timeout_s: float,
        device: torch.device,
        host: str | None,
        queue_size: int,
        max_groups: int = 64,
        on_joined: Callable[[int], None],
        on_op_done: Callable[[worker_pb2.OpDescriptor, OpResult | CollectiveError, float], None],
        rebuild_after_s: float = 10.0,
        models: ModelRegistry | None = None,
        on_data_collectives: Callable[[int, int], None] | None = None,
        before_commit: Callable[[worker_pb2.OpDescriptor], None] | None = None,
    ) -> None:
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.is_leader = rank == 0
        self._tcp_store = tcp_store
        self._store = store
        self.store = store
        self.models = models if models is not None else ModelRegistry([device])
        self.device = device
        self._on_data_collectives = on_data_collectives
        # Called on this rank once an op's outcome is settled, right before its
        # result is committed (tests use it to hold a rank at that point).
        self._before_commit = before_commit
        # Replaced results kept for reuse stay well inside a store limit, if any.
        limit = store.limit_bytes
        self._spares = collective_ops.Spares(
            max_bytes=min(512 << 20, limit // 4) if limit else 512 << 20
        )
        self._timeout_s = op_timeout_s
        self._device = device
        self._host = host
        self._queue_size = queue_size
        self.max_groups = max_groups
        self._on_joined = on_joined
        self._on_op_done = on_op_done
        self._tick_s = min(1.0, op_timeout_s / 4)
        self._rebuild_after_s = rebuild_after_s
        self._prefix = f"g{generation}"
        self._queue: collections.deque[PendingOp] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._superseded = False
        self._next_op_id = 1
        self._next_group_id = 1
        # The world group exists from the start so that ops can queue while the
        # process group forms; its handles arrive when it is built.
        self.groups: dict[int, GroupEntry] = {0: GroupEntry(0, list(range(world_size)), None)}
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.failure: str | None = None
        self.busy = False
        self._thread = threading.Thread(
            target=self._run, name=f"generation-{generation}", daemon=True
        )

    # ----------------------------------------------------------- lifecycle
    def start(self) -> GenerationRuntime:
        self._thread.start()
        return self

    def stop(self, superseded_by: int | None = None) -> None:
        """Retires this generation: no more commits; the leader tells followers to stop.

        Queued ops fail with UNAVAILABLE naming this generation and, when known,
        the one that replaced it: an op runs in the generation it was issued
        for or not at all (the SDK does not repeat it on the new membership).
        """
        with self._cond:
            self._stopping = True
            self._superseded = True
            self._cond.notify_all()
        ended = f"generation {self.generation} ended"
        if superseded_by is not None:
            ended += f" (superseded by generation {superseded_by})"
        self._fail_queued(ended)

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._queue)

    # ------------------------------------------------------------- leader API
    def allocate_group_id(self) -> int:
        with self._cond:
            gid = self._next_group_id
            self._next_group_id += 1
            return gid

    def submit(self, desc: worker_pb2.OpDescriptor) -> PendingOp:
        pending = PendingOp(desc)
        with self._cond:
            if self._stopping:
                raise Unavailable(
                    f"generation {self.generation} is over ({self.failure or 'superseded'}); "
                    "refresh the cluster and retry",
                    executed=False,
                )
            if len(self._queue) >= self._queue_size:
                raise ResourceExhausted(
                    f"the leader's op queue is full ({self._queue_size} ops); retry later"
                )
            desc.op_id = self._next_op_id
            desc.generation = self.generation
            self._next_op_id += 1
            self._queue.append(pending)
            self._cond.notify_all()
        return pending

    def cancel(self, pending: PendingOp) -> bool:
        """Removes a queued op; False if it already started."""
        with self._cond:
            if pending.started:
                return False
            pending.cancelled = True
            with contextlib.suppress(ValueError):  # already taken off the queue
                self._queue.remove(pending)
            return True

    def _take(self) -> PendingOp | None:
        deadline = time.monotonic() + self._tick_s
        with self._cond:
            while not self._queue and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            if self._stopping:
                return None
            pending = self._queue.popleft()
            pending.started = True
            return pending

    def _fail_queued(self, reason: str) -> None:
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
        for pending in queued:
            if not pending.future.done():
                pending.future.set_exception(
                    Unavailable(
                        f"{reason} before the op started; nothing was committed",
                        executed=False,
                    )
                )

    # -------------------------------------------------------------- the loop
    def _run(self) -> None:
        """Runs the generation; rebuilds its group if it breaks without being superseded.

        A group can break without a membership change (a peer stopped longer
        than the op timeout, then resumed). If the coordinator does not seal a
        new generation within ``rebuild_after_s``, every member rebuilds the same
        generation's group under a new store prefix (an epoch), so the cluster
        never stays wedged. Ranks that fail at different times converge because
        each waits the same timeout for the others at each epoch.
        """
        epoch = 0
        try:
            while True:
                failure = self._run_epoch(epoch)
                if failure is None:
                    return
                with self._cond:
                    if self._stopping:
                        return
                    self._cond.wait(self._rebuild_after_s)
                    if self._stopping:
                        return
                    self.failure = None
                epoch += 1
                log.warning(
                    "generation %d: rebuilding the process group (epoch %d) after: %s",
                    self.generation,
                    epoch,
                    failure,
                )
        finally:
            self._spares.clear()
            # Drop every group of this generation now: their sockets and threads go with them.
            self.groups = {0: GroupEntry(0, list(range(self.world_size)), None)}
            self._control = None
            self.finished.set()
            self._fail_queued(f"generation {self.generation} ended")

    def _run_epoch(self, epoch: int) -> str | None:
        """Returns None when retired cleanly, else why the group broke."""
        prefix = f"g{self.generation}" if epoch == 0 else f"g{self.generation}e{epoch}"
        current: PendingOp | None = None
        try:
            try:
                handles = build_groups(
                    self._tcp_store,
                    prefix,
                    self.rank,
                    self.world_size,
                    self._timeout_s,
                    self._device,
                    self._host,
                )
            except Exception as exc:
                raise _GroupBroken(f"could not form the process group: {exc}") from exc
            self._prefix = prefix
            self.groups = {0: GroupEntry(0, list(range(self.world_size)), handles)}
            self._control = handles.control
            self.ready.set()
            self._on_joined(self.generation)
            log.info(
                "joined generation %d as rank %d of %d", self.generation, self.rank, self.world_size
            )
            while True:
                inline = None
                announced = None
                if self.is_leader:
                    current = self._take()
                    if current is None:
                        desc = worker_pb2.OpDescriptor(
                            kind="stop" if self._stopping else "noop", generation=self.generation
                        )
                        self._call(descriptor.announce, self._control, desc)
                    else:
                        desc = current.desc
                        inline = self._inline_capacity(desc)
                        # Not waited for here: the op's first exchange is issued before
                        # the leader waits for its own send (see _collective).
                        announced = self._call(
                            descriptor.announce, self._control, desc, inline, False
                        )
                else:
                    desc, inline = self._call(descriptor.receive, self._control)
                if desc.kind == "stop":
                    return None
                if desc.kind == "noop":
                    self._spares.clear()  # idle: give kept memory back
                    continue
                outcome = self._execute(desc, inline, announced)
                if current is not None:
                    if isinstance(outcome, CollectiveError):
                        current.future.set_exception(outcome)
                    else:
                        current.future.set_result(outcome)
                    current = None
        except _GroupBroken as exc:
            self.ready.clear()
            with self._cond:
                superseded = self._superseded
                self.failure = str(exc)
            if not superseded:
                log.warning("generation %d: %s", self.generation, exc)
            if current is not None and not current.future.done():
                current.future.set_exception(
                    Unavailable(
                        f"op {current.desc.op_id} ({current.desc.kind}) failed in generation "
                        f"{self.generation}: {exc}. A worker was probably lost; the cluster "
                        "re-forms without it. The op did not complete; nothing was committed "
                        "unless every rank agreed it succeeded.",
                    )
                )
            self._fail_queued(f"the process group of generation {self.generation} broke")
            return None if superseded else str(exc)
        except Exception as exc:  # a bug: never take the daemon down with it
            log.exception("generation %d: unexpected error", self.generation)
            if current is not None and not current.future.done():
                message = op_failures.internal_message(f"generation {self.generation}", exc)
                current.future.set_exception(error_for_code(grpc.StatusCode.INTERNAL, message))
            self._fail_queued(f"generation {self.generation} hit an internal error")
            return "internal error (see the worker's log)"

    def call(self, fn, *args):
        """Runs a group operation; a backend failure means the group is broken."""
        return self._call(fn, *args)

    def fail_all(self, failures: list[agreement.RankOutcome]) -> CollectiveError:
        return self._fail_all(failures)

    def count_data_collectives(self, collectives: int, gradient_buckets: int = 0) -> None:
        if self._on_data_collectives is not None:
            self._on_data_collectives(collectives, gradient_buckets)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, dist.DistError) as exc:
            raise _GroupBroken(_backend_message(exc)) from exc

    # ------------------------------------------------------------ execution
    def _inline_capacity(self, desc: worker_pb2.OpDescriptor) -> int | None:
        """Leader: the bytes of operand every rank appends to its info (None: no inline data).

        Sized from the leader's own operand, so it is only a guess for the others;
        every rank checks that each contributor's operand fitted (from the infos)
        and otherwise runs the data collective, all taking the same branch."""
        if self._device.type != "cpu":
            return None
        if desc.kind == "barrier":
            return 0  # the exchange itself is the barrier
        if desc.kind not in _INLINE_KINDS:
            return None
        group = self.groups.get(desc.group_id)
        if group is None or self.rank not in group.ranks:
            return None
        t = self._store.peek(desc.name)
        if t is None:
            return None
        nbytes = t.numel() * t.element_size()
        if nbytes > INLINE_MAX_BYTES or nbytes * self.world_size > INLINE_MAX_TOTAL_BYTES:
            return None
        return -(-nbytes // 16) * 16  # rows stay 16-byte aligned for every dtype

    def _execute(
        self,
        desc: worker_pb2.OpDescriptor,
        inline: int | None = None,
        announced: descriptor.Announced | None = None,
    ) -> OpResult | CollectiveError:
        started = time.perf_counter()
        self.busy = True
        try:
            if desc.kind == "new_group" or desc.kind in model_collectives.MODEL_KINDS:
                if announced is not None:
                    self._call(announced.wait)
                if desc.kind == "new_group":
                    result = self._new_group(desc, started)
                else:
                    result = model_collectives.run_model_op(self, desc, started)
            else:
                result = self._collective(desc, started, inline, announced)
        finally:
            self.busy = False
        if isinstance(result, CollectiveError):
            # Every rank words the failure the same way, with the op id the
            # worker logs carry, so a client's error can be found in them.
            result = error_for_code(
                result.code,
                f"op {desc.op_id} ({desc.kind}, generation {self.generation}): {result.message}",
                executed=result.executed,
            )
        self._on_op_done(desc, result, time.perf_counter() - started)
        return result

    def _fail_all(self, failures: list[agreement.RankOutcome]) -> CollectiveError:
        first = failures[0]
        ranks = ", ".join(str(f.rank) for f in failures)
        return error_for_code(first.code, f"failed on rank(s) {ranks}: {first.message}")

    def _new_group(
        self, desc: worker_pb2.OpDescriptor, started: float
    ) -> OpResult | CollectiveError:
        ranks = sorted(desc.group_ranks)
        handles = None
        code, message = grpc.StatusCode.OK, ""
        try:
            check_group_cap(subgroup_count(self.groups), self.max_groups, self.generation)
        except ResourceExhausted as exc:
            code, message = exc.code, exc.message
        if self.rank in ranks and code == grpc.StatusCode.OK:
            try:
                handles = build_groups(
                    self._tcp_store,
                    f"{self._prefix}/grp{desc.group_id}",
                    ranks.index(self.rank),
                    len(ranks),
                    self._timeout_s,
                    self._device,
                    self._host,
                )
            except Exception as exc:
                code = grpc.StatusCode.UNAVAILABLE
                message = f"could not build group: {_backend_message(exc)}"
        failures = self._call(agreement.agree, self._control, self.world_size, code, message)
        if failures:
            return self._fail_all(failures)
        self.groups[desc.group_id] = GroupEntry(desc.group_id, ranks, handles)
        return OpResult(
            desc.op_id, self.generation, "", ranks, None, (), time.perf_counter() - started
        )

    def _collective(
        self,
        desc: worker_pb2.OpDescriptor,
        started: float,
        inline: int | None = None,
        announced: descriptor.Announced | None = None,
    ) -> OpResult | CollectiveError:
        group = self.groups[desc.group_id]
        member = self.rank in group.ranks
        kind = desc.kind
        target = desc.out or desc.name
        operand = self._store.peek(desc.name) if member and kind != "barrier" else None
        if operand is not None and (operand.is_conj() or operand.is_neg()):
            operand = operand.resolve_conj().resolve_neg()
        values = validation.info_values(
            operand, member, self._store.quota_state(target) if member else (0, -1)
        )
        fence: Fence | None = None
        try:
            if inline is not None and member and kind != "barrier" and not self.is_leader:
                # The inline exchange is this rank's last one with the leader.
                fence = self._store.fence(target, 2 * self._timeout_s)
            exchanged = self._call(
                agreement.exchange,
                self._control,
                self.world_size,
                values,
                operand,
                inline or 0,
                announced,
            )
            infos = exchanged.infos
            op = ReduceOp.from_wire(desc.op)
            plan = validation.decide(kind, desc.name, group.ranks, infos, desc.root, op, target)
            if isinstance(plan, validation.OpError):
                return error_for_code(plan.code, plan.message)
            if kind == "barrier" and inline is not None:
                # Every rank of the world has entered this exchange: that is the barrier.
                return self._describe(desc, group, plan, target, started)
            contributors = [desc.root] if kind == "broadcast" else group.ranks
            if inline is not None and all(infos[r].nbytes <= inline for r in contributors):
                if member:
                    result = self._inline_member(kind, desc, group, exchanged, contributors, op)
                    self.count_data_collectives(1)
                    self._commit(desc, target, result)
                return self._describe(desc, group, plan, target, started)

            result: torch.Tensor | None = None
            code, message = grpc.StatusCode.OK, ""
            if member:
                try:
                    result = self._run_member(kind, desc, group, operand, plan, op)
                    self.count_data_collectives(1)
                except _GroupBroken:
                    raise
                except CollectiveError as exc:
                    code, message = exc.code, exc.message
                except Exception as exc:  # local to this rank: the op fails, the group stays
                    dtype = operand.dtype if operand is not None else None
                    code, message = op_failures.local_failure(exc, kind, dtype)
            if fence is None and member and kind != "barrier" and not self.is_leader:
                # The agreement is this rank's last exchange with the leader.
                fence = self._store.fence(target, 2 * self._timeout_s)
            failures = self._call(agreement.agree, self._control, self.world_size, code, message)
            if failures:
                return self._fail_all(failures)
            # Every rank agreed the op succeeded: commit, even if this generation is
            # being retired right now, so that a reported success is true everywhere.
            self._commit(desc, target, result)
            return self._describe(desc, group, plan, target, started)
        finally:
            if fence is not None:
                fence.release()

    def _commit(self, desc, target: str, result: torch.Tensor | None) -> None:
        if self._before_commit is not None:
            self._before_commit(desc)
        if result is not None:
            # Quota was judged for every rank before the data moved: a put racing
            # in since must not make one rank skip a commit the others make.
            old = self._store.replace(target, result)
            if old is not None:
                self._spares.offer(old)

    def _inline_member(
        self,
        kind: str,
        desc: worker_pb2.OpDescriptor,
        group: GroupEntry,
        exchanged: agreement.Exchanged,
        contributors: list[int],
        op: ReduceOp,
    ) -> torch.Tensor | None:
        """This member's result from the operands that travelled inline.

        Pure arithmetic on bytes every member received identically (validation
        already passed everywhere), so it cannot fail on one rank only; if it
        ever raised, this rank leaves the group rather than diverge silently."""
        parts: list[torch.Tensor | None] = [None] * len(group.ranks)
        for r in contributors:
            parts[group.index(r)] = exchanged.payload(r, exchanged.infos[r])
        root_index = group.index(desc.root) if desc.root in group.ranks else 0
        try:
            result = collective_ops.inline_result(
                kind, parts, op, group.index(self.rank), root_index
            )
        except Exception as exc:
            log.exception("op %d (%s): computing the inline result failed", desc.op_id, kind)
            raise _GroupBroken(f"computing the result of op {desc.op_id} failed: {exc}") from exc
        if result is not None and result.device != self._device:
            result = result.to(self._device)
        return result

    def _run_member(self, kind, desc, group: GroupEntry, operand, plan, op) -> torch.Tensor | None:
        assert group.handles is not None
        pg = group.handles.data
        size = len(group.ranks)
        index = group.index(self.rank)
        if operand is not None and operand.device != self._device:
            operand = operand.to(self._device)
        alloc = self._spares.empty
        try:
            if kind == "broadcast":
                return collective_ops.broadcast(
                    pg,
                    operand,
                    group.index(desc.root),
                    index,
                    plan.dtype,
                    plan.shape,
                    self._device,
                    alloc,
                )
            if kind == "all_reduce":
                return collective_ops.all_reduce(pg, operand, op, size, alloc)
            if kind == "reduce":
                reduced = collective_ops.reduce(pg, operand, op, size, alloc)
                return reduced if self.rank == desc.root else None
            if kind == "all_gather":
                return collective_ops.all_gather(pg, operand, size, alloc)
            if kind == "gather":
                root = group.index(desc.root)
                return collective_ops.gather(pg, operand, size, root, index, alloc)
            if kind == "reduce_scatter":
                return collective_ops.reduce_scatter(pg, operand, op, size, index, alloc)
            if kind == "all_to_all":
                return collective_ops.all_to_all(pg, operand, alloc)
            if kind == "barrier":
                collective_ops.barrier(pg, self._device)
                return None
        except Exception as exc:
            if op_failures.is_transport_failure(exc):
                raise _GroupBroken(_backend_message(exc)) from exc
            raise
        raise ValueError(f"unknown op kind {kind!r}")

    def _describe(self, desc, group: GroupEntry, plan, target: str, started: float) -> OpResult:
        kind = desc.kind
        shape = tuple(plan.shape)
        size = len(group.ranks)
        if kind in ("all_gather", "gather"):
            shape = (size, *shape)
        elif kind == "reduce_scatter":
            shape = (shape[0] // size, *shape[1:])
        if kind in ("reduce", "gather"):
            ranks = [desc.root]
        elif kind == "barrier":
            ranks, target = [], ""
        else:
            ranks = list(group.ranks)
        return OpResult(
            desc.op_id,
            self.generation,
            target if kind != "broadcast" else desc.name,
            ranks,
            plan.dtype,
            shape,
            time.perf_counter() - started,
        )
