"""One generation's loop on one worker: sequence, announce, dispatch.

The leader (rank 0) admits ops into its :class:`~sequencer.Sequencer` (a
bounded FIFO bound to this generation). One thread per rank runs the
generation: on the leader it takes the next op (or, when idle, a no-op tick
that keeps followers inside their receive timeout and proves the group alive)
and announces it through the control group; on followers it receives the
descriptors. Every rank then runs the op's handler (``handlers``), the same op
in the same order, which is what torch.distributed requires and what
concurrent clients could never guarantee by themselves.

On the leader one thread at a time runs ops: the loop, or, for an op on small
operands submitted while the loop is parked with nothing queued, the
submitter's own thread (a claim, :meth:`Generation.run_claimed`: the RPC
thread announces and runs it, two thread hand-offs fewer), while the loop
waits for it. Which ops make a run, on which thread, and when their clients
are answered is the run schedule's (``run_schedule``, over the ``sequencer``'s
rules). What an op does is its handler's business; this module only
sequences, announces, dispatches, and turns a broken process group into a
retired or rebuilt one.

A generation that is superseded admits nothing more, fails what is queued
(naming both generations), and its thread is left to finish or time out
(gloo cannot interrupt a pending op) while the next generation runs beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist

from collectives.errors import CollectiveError, error_for_code
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.data.replaced_memory import ReplacedMemory, pool_bytes
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.engine import descriptor
from collectives_server.worker.engine.carried_groups import rebuild_groups
from collectives_server.worker.engine.control_channel import ControlChannel
from collectives_server.worker.engine.descriptor import Announced
from collectives_server.worker.engine.flight_recorder import FlightRecorder, FlightSlot
from collectives_server.worker.engine.groups_ahead import FormedGroups
from collectives_server.worker.engine.handlers import handler_for
from collectives_server.worker.engine.handlers.fused_ops import run_fused
from collectives_server.worker.engine.handlers.group_ops import missing_group
from collectives_server.worker.engine.handlers.model_ops import ModelOpResult
from collectives_server.worker.engine.handlers.publish_ops import PublishResult
from collectives_server.worker.engine.handlers.tensor_ops import inline_capacity
from collectives_server.worker.engine.op_context import (
    Announcement,
    GroupBroken,
    GroupEntry,
    OpContext,
    OpResult,
)
from collectives_server.worker.engine.process_groups import build_groups, release_groups
from collectives_server.worker.engine.run_schedule import Answer, RunSchedule, set_outcomes
from collectives_server.worker.engine.sequencer import EpochEnd, Sequencer, Ticket
from collectives_server.worker.kernels import op_failures
from collectives_server.worker.models.registry import ModelRegistry

__all__ = ["first_group_id", "Generation", "GenerationHooks", "GenerationSpec"]

log = logging.getLogger(__name__)

Outcome = OpResult | ModelOpResult | PublishResult | CollectiveError

_Item = tuple[worker_pb2.OpDescriptor, int | None]  # an op and its inline capacity

# The outcome recorded for an op its group broke under before this rank finished it.
_UNFINISHED = "did not finish here: the process group broke or the generation ended"
# A rebuild waits this many op timeouts for every member to arrive at its epoch, then
# tries the next; it looks at the rendezvous store every _REBUILD_POLL_S meanwhile.
_REBUILD_WAIT_OP_TIMEOUTS = 6
_REBUILD_POLL_S = 0.05
# ... and at most this often while the store's host does not answer.
_REBUILD_POLL_MAX_S = 1.0
# A gated generation waits for its drain's handoff at most this many op timeouts
# (the coordinator's own deadline for a handoff is 4 by default).
_GATE_OP_TIMEOUTS = 8


def _raise_counter(store: dist.Store, key: str, at_least: int) -> int:
    """The store's counter ``key``, raised to ``at_least`` if it was lower (atomically:
    compare-and-set); its value now."""
    current = store.add(key, 0)
    while current < at_least:
        current = int(store.compare_set(key, str(current), str(at_least)))
    return current


# Group ids a generation gives out: its own range, so that an id is never given out
# twice in a lineage of generations a drain carried over (their groups keep their
# ids). A group destroyed in one generation must not see its id go to another's new
# group: a client still holding the destroyed one would run its ops on the new one's
# ranks, since an op names its group by id alone.
GROUP_IDS_PER_GENERATION = 1 << 32


def first_group_id(generation: int) -> int:
    """The first sub-group id ``generation`` gives out (group 0 is the world)."""
    return generation * GROUP_IDS_PER_GENERATION + 1


@dataclass(frozen=True)
class GenerationSpec:
    """Which generation a worker runs and with what: its place in it, the stores it
    forms its groups through and commits into, its device and its limits."""

    generation: int
    rank: int
    world_size: int
    # The rendezvous store every member forms its groups through, or how to connect to
    # it: then the generation's own thread connects (its host may be gone: the
    # generation then does not form, and whoever started it is not held up).
    tcp_store: dist.Store | Callable[[], dist.Store]
    store: TensorStore
    device: torch.device
    host: str | None  # the interface gloo binds (None: torch's choice)
    op_timeout_s: float
    queue_size: int  # the leader's op queue (sequencer)
    # Which membership this generation is (collectives_server.membership_digest): the
    # group forms under a store prefix that includes it, the leader stamps it
    # on every op, and an op sent or announced for another one is refused.
    membership_digest: str = ""
    max_groups: int = 64
    # How long a broken group waits for a new generation before it rebuilds its own.
    rebuild_after_s: float = 10.0
    models: ModelRegistry | None = None  # None: an empty registry on ``device``
    # The worker's replaced memory, shared with its puts (replaced_memory.py);
    # None: one of the generation's own.
    replaced: ReplacedMemory | None = None
    # The worker's flight recorder (flight_recorder.py); None: nothing recorded.
    recorder: FlightRecorder | None = None
    # A generation a drain carried over (rank for rank the one before): the groups this
    # rank held in the one before (id -> global ranks), rebuilt as its first step
    # (carried_groups.py). None: not carried over, no groups kept.
    carried_groups: dict[int, tuple[int, ...]] | None = None
    # A generation sealed by a drain whose handoff has not ended: its groups form at
    # once, beside the copy, and its first step waits for :meth:`Generation.open`
    # (the handoff ended; the successor's tensors are installed).
    gated: bool = False
    # The world groups its members formed ahead while a drain prepared it (they use
    # them instead of forming their own at epoch 0); None: formed at the seal.
    formed_ahead: FormedGroups | None = None


@dataclass(frozen=True)
class GenerationHooks:
    """What a generation tells its worker (joined, an op done, counts), and what the
    worker runs inside it once its group formed (``sync_models``)."""

    on_joined: Callable[[int], None]  # the generation number, once this rank joined
    on_op_done: Callable[[worker_pb2.OpDescriptor, Outcome, float], None]  # latency in s
    on_data_collectives: Callable[[int, int], None] | None = None  # collectives, buckets
    on_fused: Callable[[int], None] | None = None  # the op count of each fused run
    # Leader: the rank an agreed op waited for (the last to reach it).
    on_straggler: Callable[[int], None] | None = None
    # Run by every rank once its group formed (model_sync's collective part); what it
    # returns runs once the generation is open (a gated one's handoff ended), before
    # the rank reports joined.
    sync_models: Callable[[OpContext], Callable[[], object]] | None = None


class Generation:
    """One generation on this worker: its loop thread, its leader's queue, its groups."""

    def __init__(self, spec: GenerationSpec, hooks: GenerationHooks) -> None:
        self._spec, self._hooks = spec, hooks
        self.generation = spec.generation
        self.membership_digest = spec.membership_digest
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.is_leader = spec.rank == 0
        self.store = spec.store
        self.models = spec.models if spec.models is not None else ModelRegistry([spec.device])
        self.max_groups = spec.max_groups
        replaced = spec.replaced
        if replaced is None:
            replaced = ReplacedMemory(max_bytes=pool_bytes(spec.store.limit_bytes))
        self._replaced = replaced
        recorder = spec.recorder
        self._recorder = recorder if recorder is not None and recorder.enabled else None
        self._channel: ControlChannel | None = None  # this epoch's control rounds
        # The rendezvous store, once connected (by this generation's thread).
        self._tcp_store: dist.Store | None = None if callable(spec.tcp_store) else spec.tcp_store
        self._ahead = spec.formed_ahead  # until its groups are taken (released if never)
        if self._ahead is not None:
            self._tcp_store = self._ahead.store
        self._cond = threading.Condition()
        self._seq = Sequencer(
            spec.generation,
            spec.queue_size,
            min(1.0, spec.op_timeout_s / 4),
            membership_digest=spec.membership_digest,
        )
        self._schedule = RunSchedule(self._seq, self._cond)
        self._next_group_id = first_group_id(spec.generation)
        # Leader: the epoch's context while ops may run (a submitter that claimed a
        # small op runs it in this context, see run_claimed).
        self._ctx: OpContext | None = None
        # The world group exists from the start so that ops can queue while the
        # process group forms; its handles arrive when it is built.
        self.groups: dict[int, GroupEntry] = {0: GroupEntry(0, list(range(spec.world_size)), None)}
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.opened = not spec.gated  # (see GenerationSpec.gated; under _cond)
        # Set once no op runs in it any more (before its groups are released).
        self._ops_over = threading.Event()
        self.failure: str | None = None
        self.busy = False
        self._thread = threading.Thread(
            target=self._run, name=f"generation-{spec.generation}", daemon=True
        )

    # ----------------------------------------------------------- lifecycle
    def start(self) -> Generation:
        self._thread.start()
        return self

    def stop(self, superseded_by: int | None = None) -> None:
        """Retires this generation: no more admissions; the leader tells followers to stop.

        Queued ops fail with UNAVAILABLE naming this generation and, when known,
        the one that replaced it: an op runs in the generation it was issued
        for or not at all (the SDK does not repeat it on the new membership).
        """
        with self._cond:
            self._seq.close(self.failure or "retired", superseded_by)
            self._cond.notify_all()

    def open(self) -> None:
        """Lets a gated generation take its first step (nothing if open already)."""
        with self._cond:
            self.opened = True
            self._cond.notify_all()

    def wait_ended(self, timeout_s: float) -> bool:
        """Whether this generation's ops ended (after :meth:`stop`) within ``timeout_s``:
        its last op is over, on this rank, and nothing more runs in it (its groups may
        still be being released)."""
        return self._ops_over.wait(timeout_s)

    def held_groups(self) -> dict[int, tuple[int, ...]]:
        """The sub-groups this rank holds (id -> global ranks), group 0 aside."""
        with self._cond:
            return {gid: tuple(e.ranks) for gid, e in self.groups.items() if gid != 0}

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return self._seq.depth

    # ------------------------------------------------------------- leader API
    def allocate_group_id(self) -> int:
        with self._cond:
            gid = self._next_group_id
            self._next_group_id += 1
            return gid

    def submit(
        self,
        desc: worker_pb2.OpDescriptor,
        timeout_s: float | None = None,
        expected_generation: int = 0,
        claim_if_idle: bool = False,
        expected_digest: str = "",
        client: str = "",
    ) -> Ticket:
        """Admits ``desc`` (raises UNAVAILABLE / RESOURCE_EXHAUSTED when it cannot be);
        the ticket's future gets the outcome on this rank.

        With ``claim_if_idle``, a small op that finds the loop idle and nothing queued
        is claimed for the caller (``ticket.claimed``): the caller must then run it
        with :meth:`run_claimed`. ``client``: who issued it (the flight recorder's)."""
        with self._cond:
            ticket = self._seq.admit(
                desc, timeout_s if timeout_s is not None else 2 * self._spec.op_timeout_s,
                expected_generation, expected_digest,
            )  # fmt: skip
            ticket.client = client
            ctx = self._ctx  # small operands only, judged only when the op is claimable
            claimable = claim_if_idle and ctx is not None and self._seq.may_claim(ticket)
            if claimable and inline_capacity(ctx, desc) is not None:
                self._seq.claim(ticket)
            else:
                self._cond.notify_all()
        return ticket

    def run_claimed(self, ticket: Ticket) -> None:
        """Runs the claimed ``ticket`` (and what fuses with it) on the calling thread,
        as the loop would have, and sets its outcome: two thread hand-offs fewer per op.

        The loop waits until it is done; a broken group or an internal error ends
        the epoch here as in the loop, which then rebuilds or retires it."""
        assert ticket.claimed and self._seq.claimed
        ctx = self._ctx
        assert ctx is not None
        current: list[Ticket] = []
        try:
            claimed = self._schedule.claimed_run(functools.partial(inline_capacity, ctx))
            if claimed is not None:
                current, run = claimed
                pending = self._announce(ctx, run.items)
                self._run_ops(ctx, current, run.items, pending, time.monotonic())
                current = []
        except GroupBroken as exc:
            self._end_epoch(self._broken(exc, current))
        except Exception as exc:  # a bug: fail this run, end the epoch as the loop would
            self._end_epoch(self._internal_error(exc, current))
        finally:
            with self._cond:
                # A loop parked with nothing to do sleeps on (its tick is not due:
                # this op was announced); otherwise it goes on from here.
                if self._seq.release():
                    self._cond.notify_all()

    def _end_epoch(self, failure: str | None) -> None:
        with self._cond:
            self._seq.end_epoch(failure)

    def check_generation(self, expected: int, expected_digest: str = "") -> None:
        """Raises UNAVAILABLE unless ``expected`` is 0 or this generation, and
        ``expected_digest`` is "" or this generation's membership digest."""
        self._seq.check_generation(expected, expected_digest)

    def cancel(self, ticket: Ticket) -> bool:
        """Removes a queued op; False if it already started."""
        with self._cond:
            return self._seq.cancel(ticket)

    def _drain(self, why: str) -> None:
        with self._cond:
            self._seq.drain(why)

    # -------------------------------------------------------------- the loop
    def _run(self) -> None:
        """Runs the generation; rebuilds its group if it breaks without being superseded.

        A group can break without a membership change (a peer stopped longer
        than the op timeout, then resumed). If the coordinator does not seal a
        new generation within ``rebuild_after_s``, every member rebuilds the same
        generation's group under a new store prefix (an epoch), so the cluster
        never stays wedged. Ranks that fail at different times (one at once, one
        only when its op times out) converge on one epoch through the rendezvous
        store (:meth:`_rebuild_epoch`): none forms it before all have arrived.
        """
        epoch = 0
        try:
            while True:
                failure = self._run_epoch(epoch)
                if failure is None:
                    return
                with self._cond:
                    if self._seq.closed:
                        return
                    self._cond.wait(self._spec.rebuild_after_s)
                    if self._seq.closed:
                        return
                    self.failure = None
                rebuilt = self._rebuild_epoch(epoch)
                if rebuilt is None:
                    return
                epoch = rebuilt
                log.warning(
                    "generation %d: rebuilding the process group (epoch %d) after: %s",
                    self.generation,
                    epoch,
                    failure,
                )
        finally:
            if self._ahead is not None:
                self._ahead.release()
            self._ops_over.set()
            # End every group of this generation now (NCCL: aborted); their sockets and
            # threads go with them.
            release_groups(self.groups)
            self.groups = {0: GroupEntry(0, list(range(self.world_size)), None)}
            self.finished.set()
            with self._cond:
                self._seq.close(self.failure or "retired")

    def _rendezvous(self) -> dist.Store:
        """The rendezvous store, connected on first use (raises as the connection does)."""
        if self._tcp_store is None:
            connect = self._spec.tcp_store
            assert callable(connect)
            self._tcp_store = connect()
        return self._tcp_store

    def _rebuild_epoch(self, failed: int) -> int | None:
        """The epoch every member rebuilds in after ``failed`` broke, once all of them
        have arrived at it; None if the generation ended meanwhile.

        The epoch is a counter in the rendezvous store that only grows: a rank takes
        the larger of it and ``failed + 1``, so one that failed late joins the epoch
        the others already wait in instead of counting its own. Each rank then
        counts itself in and waits (polling, woken by the generation's end) for the
        others, however late they fail, rather than in gloo's rendezvous, which gives
        up after one op timeout. An epoch not complete within
        ``_REBUILD_WAIT_OP_TIMEOUTS`` op timeouts is left for the next one."""
        counter = f"g{self.generation}m{self.membership_digest}/epoch"
        patience = _REBUILD_WAIT_OP_TIMEOUTS * self._spec.op_timeout_s
        epoch, arrived_at = failed + 1, -1
        deadline = time.monotonic() + patience
        poll_s = _REBUILD_POLL_S
        while True:
            try:
                store = self._rendezvous()
                epoch = _raise_counter(store, counter, epoch)
                arrived = f"g{self.generation}m{self.membership_digest}e{epoch}/rebuild-arrived"
                if arrived_at != epoch:
                    store.add(arrived, 1)
                    arrived_at, deadline = epoch, time.monotonic() + patience
                if store.add(arrived, 0) >= self.world_size:
                    return epoch
                poll_s = _REBUILD_POLL_S
            except (RuntimeError, dist.DistError) as exc:  # the store's host is gone: wait
                log.debug("generation %d: rendezvous store: %s", self.generation, exc)
                # Less often while it stays gone (a killed host: the coordinator seals
                # a generation without it, which ends this wait at once): torch logs
                # each failed call with its C++ stack.
                poll_s = min(2 * poll_s, _REBUILD_POLL_MAX_S)
            if time.monotonic() > deadline:
                epoch += 1
            with self._cond:
                if self._seq.closed:
                    return None
                self._cond.wait(poll_s)
                if self._seq.closed:
                    return None

    def _join(self, epoch: int) -> OpContext:
        # One generation number could name two memberships only through a bug
        # elsewhere; the digest in the prefix keeps them from ever meeting.
        prefix = f"g{self.generation}m{self.membership_digest}"
        if epoch:
            prefix += f"e{epoch}"
        # A rebuilt epoch keeps the broken one's sub-groups (carried_groups); until they
        # are built again they stay listed, so that an op naming one waits in the queue.
        held = self.held_groups() if epoch else {}
        release_groups(self.groups)  # a broken epoch's groups, before the next ones
        ahead, self._ahead = self._ahead, None  # (only epoch 0 can find it)
        try:
            if ahead is not None:
                store, prefix, handles, self._channel = (
                    ahead.store,
                    ahead.prefix,
                    ahead.handles,
                    ahead.channel,
                )
            else:
                store = self._rendezvous()
                where = (store, prefix, self.rank, self.world_size, self._spec.op_timeout_s)
                handles = build_groups(*where, self._spec.device, self._spec.host)
                self._channel = ControlChannel.connect(
                    dist.PrefixStore(f"{prefix}/ctlsock", store),
                    *where[2:],
                    self._spec.host,
                )
        except Exception as exc:
            raise GroupBroken(f"could not form the process group: {exc}") from exc
        self.groups = {0: GroupEntry(0, list(range(self.world_size)), handles)}
        listed = {gid: GroupEntry(gid, list(ranks), None) for gid, ranks in held.items()}
        self.groups.update(listed)
        ctx = OpContext(
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            device=self._spec.device,
            host=self._spec.host,
            timeout_s=self._spec.op_timeout_s,
            tcp_store=store,
            prefix=prefix,
            store=self.store,
            models=self.models,
            groups=self.groups,
            control=self._channel,
            replaced=self._replaced,
            max_groups=self.max_groups,
            on_data_collectives=self._hooks.on_data_collectives,
            on_straggler=self._hooks.on_straggler if self.is_leader else None,
        )
        # What the ranks do together comes before the gate, beside a drain's copy:
        # the models' exchange and the carried groups; what this rank does with the
        # models it received (the successor's gradients among it) comes after.
        host = self._hooks.sync_models(ctx) if self._hooks.sync_models is not None else None
        carried = held if epoch else self._spec.carried_groups
        if carried is not None:
            next_id = rebuild_groups(ctx, carried, held_by_all=bool(epoch))
            with self._cond:
                self._next_group_id = max(self._next_group_id, next_id)
                for gid, entry in listed.items():
                    if self.groups.get(gid) is entry:  # not held alike by every rank
                        del self.groups[gid]
        with self._cond:
            patience = _GATE_OP_TIMEOUTS * self._spec.op_timeout_s
            self._cond.wait_for(lambda: self.opened or self._seq.closed, patience)
            if not self.opened:
                raise GroupBroken("the drain that sealed it did not end (retired, or too long)")
        if host is not None:
            host()
        self.ready.set()
        self._hooks.on_joined(self.generation)
        log.info(
            "joined generation %d as rank %d of %d", self.generation, self.rank, self.world_size
        )
        return ctx

    def _next_ops(
        self, ctx: OpContext, unanswered: list[Answer]
    ) -> tuple[list[Ticket], list[_Item]] | EpochEnd:
        """Leader: takes the next op, or run of fused ops, or a tick (a no-op, or a
        stop); follower: receives what the leader announced. Returns (the leader's
        tickets, the ops), or, on the leader, the end of the epoch a claimed op ended.
        The leader answers ``unanswered`` before it waits for an op."""
        if not self.is_leader:
            items = ctx.call(descriptor.receive_batch, ctx.control)
            for desc, _ in items:
                self._check_announced(desc)
            return [], items
        scheduled = self._schedule.next_run(functools.partial(inline_capacity, ctx), unanswered)
        if isinstance(scheduled, EpochEnd):
            return scheduled
        if scheduled is None:
            kind = OpKind.STOP if self._seq.closed else OpKind.NOOP
            tick = worker_pb2.OpDescriptor(
                kind=kind, generation=self.generation, membership_digest=self.membership_digest
            )
            return [], [(tick, None)]
        tickets, run = scheduled
        return tickets, run.items

    def _check_announced(self, desc: worker_pb2.OpDescriptor) -> None:
        """Follower: an op announced for another generation or membership ends this
        group before any data moves (the leader learns it when the channel closes)."""
        if (desc.generation, desc.membership_digest) != (self.generation, self.membership_digest):
            raise GroupBroken(
                f"the leader announced op {desc.op_id} for generation {desc.generation} "
                f"(membership {desc.membership_digest or 'none'}), but this rank's group is "
                f"generation {self.generation} (membership {self.membership_digest or 'none'}); "
                "the op was refused before any data moved"
            )

    def _announce(self, ctx: OpContext, items: list[_Item]) -> Announced | None:
        """Leader: announces ``items``; returns the pending announcement of ops (not
        waited for here: the op's first exchange is issued before the leader waits
        for its own send, see handlers)."""
        if len(items) > 1:
            pending = ctx.call(descriptor.announce_batch, ctx.control, items, False)
        elif items[0][0].kind in (OpKind.NOOP, OpKind.STOP):
            ctx.call(descriptor.announce, ctx.control, items[0][0])
            pending = None
        else:
            desc, inline = items[0]
            pending = ctx.call(descriptor.announce, ctx.control, desc, inline, False)
        with self._cond:
            self._seq.announced()
        return pending

    def _run_epoch(self, epoch: int) -> str | None:
        """Returns None when retired cleanly, else why the group broke."""
        current: list[Ticket] = []
        # The leader answers a run's clients once the next run is announced (or before
        # it waits for one): their threads then take the GIL while this one waits for
        # the followers' half of that run's exchange, not before its announcement.
        unanswered: list[Answer] = []
        try:
            ctx = self._join(epoch)
            with self._cond:
                self._ctx = ctx
                self._seq.open_epoch()
            while True:
                ops = self._next_ops(ctx, unanswered)
                if isinstance(ops, EpochEnd):
                    return ops.failure
                current, items = ops
                pending = self._announce(ctx, items) if self.is_leader else None
                announced = time.monotonic()
                set_outcomes(unanswered)
                kind = items[0][0].kind
                if kind == OpKind.STOP:
                    return None
                if kind == OpKind.NOOP:
                    continue
                unanswered = self._run_ops(ctx, current, items, pending, announced, False)
                current = []
        except GroupBroken as exc:
            set_outcomes(unanswered)
            return self._broken(exc, current)
        except Exception as exc:  # a bug: never take the daemon down with it
            set_outcomes(unanswered)
            return self._internal_error(exc, current)
        finally:
            set_outcomes(unanswered)
            with self._cond:
                if self._ctx is not None:
                    self._ctx.end_ops()
                self._ctx = None
                self._seq.close_epoch()
            # Peers blocked on this rank learn at once that its group is gone.
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    def _run_ops(
        self,
        ctx: OpContext,
        tickets: list[Ticket],
        items: list[_Item],
        pending: Announced | None,
        announced: float = 0.0,
        answer: bool = True,
    ) -> list[Answer]:
        """Runs announced ops (one, or a fused run) and sets their tickets' outcomes,
        recording each in the flight recorder (announced at ``announced``).

        A fused run's outcomes are set together when it ends, those of the ops that
        finished even when a later one raised: each set wakes a client's RPC thread,
        which would contend for the GIL with the rest of the run (set together, many
        clients get more ops through: see docs/perf-log.md). Without ``answer`` a run
        that ended whole is left for the caller to answer
        (``run_schedule.set_outcomes``): returns its tickets and outcomes; a run cut
        short is answered here."""
        outcomes: list[Outcome] = []
        answers: list[Answer] = []
        slots = self._record(tickets, items, announced)
        try:
            if len(items) == 1:
                desc, inline = items[0]
                outcome = self._execute(ctx, desc, Announcement(inline, pending), slots[0])
                outcomes.append(outcome)
            else:
                for outcome in self._execute_fused(ctx, items, pending, slots):
                    outcomes.append(outcome)
        finally:
            if self._recorder is not None and len(outcomes) < len(items):
                now = time.monotonic()
                for slot in slots[len(outcomes) :]:
                    if slot is not None and slot.code < 0:
                        slot.finish(now, grpc.StatusCode.UNAVAILABLE.value[0], _UNFINISHED)
            answers = list(zip(tickets, outcomes, strict=False))
            if answer or len(outcomes) < len(items):
                set_outcomes(answers)
        return answers

    def _record(
        self, tickets: list[Ticket], items: list[_Item], announced: float
    ) -> list[FlightSlot | None]:
        """Opens a flight-recorder slot per op (leader: with its admission and client)."""
        recorder = self._recorder
        if recorder is None:
            return [None] * len(items)
        slots: list[FlightSlot | None] = []
        groups = self.groups
        for i, (desc, _) in enumerate(items):
            entry = groups.get(desc.group_id)
            ticket = tickets[i] if i < len(tickets) else None
            if ticket is None:
                slots.append(
                    recorder.open(desc, self.rank, entry.ranks if entry else None, announced)
                )
            else:
                slots.append(
                    recorder.open(
                        desc,
                        self.rank,
                        entry.ranks if entry else None,
                        announced,
                        ticket.admitted,
                        ticket.client,
                    )
                )
        return slots

    def _internal_error(self, exc: Exception, current: list[Ticket]) -> str:
        log.exception("generation %d: unexpected error", self.generation)
        message = op_failures.internal_message(f"generation {self.generation}", exc)
        for ticket in current:
            ticket.fail(error_for_code(grpc.StatusCode.INTERNAL, message))
        self._drain(f"generation {self.generation} hit an internal error")
        return "internal error (see the worker's log)"

    def _broken(self, exc: GroupBroken, current: list[Ticket]) -> str | None:
        self.ready.clear()
        with self._cond:
            superseded = self._seq.closed
            self.failure = str(exc)
        if not superseded:
            log.warning("generation %d: %s", self.generation, exc)
        for ticket in current:
            ticket.fail(op_failures.lost_with_group(ticket.desc, self.generation, exc))
        self._drain(f"the process group of generation {self.generation} broke")
        return None if superseded else str(exc)

    def _execute(
        self,
        ctx: OpContext,
        desc: worker_pb2.OpDescriptor,
        ann: Announcement,
        slot: FlightSlot | None = None,
    ) -> Outcome:
        started = time.perf_counter()
        ctx.op_started, ctx.synced_at = time.monotonic(), 0.0
        ctx.begin_op()
        entry = self.groups.get(desc.group_id)
        ctx.op_ranks = entry.ranks if entry is not None else None
        if slot is not None:
            slot.started = ctx.op_started
        self.busy = True
        try:
            result = missing_group(ctx, desc, ann) or handler_for(desc.kind)(ctx, desc, ann)
        finally:
            self.busy = False
        return self._conclude(desc, result, time.perf_counter() - started, slot)

    def _execute_fused(
        self,
        ctx: OpContext,
        items: list[_Item],
        pending: Announced | None,
        slots: list[FlightSlot | None],
    ) -> Iterator[Outcome]:
        """Each op's outcome of a fused run, as it finishes (``handlers.fused_ops``)."""
        started = time.perf_counter()
        ctx.op_started = now = time.monotonic()
        ctx.synced_at = 0.0
        ctx.begin_op()
        entry = self.groups.get(items[0][0].group_id)
        ctx.op_ranks = entry.ranks if entry is not None else None
        if self._recorder is not None:
            for slot in slots:
                if slot is not None:
                    slot.started = now
        if self._hooks.on_fused is not None:
            self._hooks.on_fused(len(items))
        self.busy = True
        try:
            results = zip(items, slots, run_fused(ctx, items, pending), strict=False)
            for (desc, _), slot, result in results:
                yield self._conclude(desc, result, time.perf_counter() - started, slot)
        finally:
            self.busy = False

    def _conclude(
        self,
        desc: worker_pb2.OpDescriptor,
        result: Outcome,
        latency: float,
        slot: FlightSlot | None = None,
    ) -> Outcome:
        if isinstance(result, CollectiveError):
            result = op_failures.worded(desc, self.generation, result)
            if slot is not None:
                slot.finish(time.monotonic(), result.code.value[0], result.message)
        else:
            result = dataclasses.replace(result, latency_s=latency)
            if slot is not None:
                slot.finish(time.monotonic(), 0, "", result)
        self._hooks.on_op_done(desc, result, latency)
        return result
