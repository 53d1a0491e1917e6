"""This worker's part in a drain, read from each Cluster message it is sent.

While a drain prepares the next generation (``Handoff.preparing``), each of its
members forms that generation's groups ahead (``engine.groups_ahead``) and says so
in its heartbeats. While ``Cluster.handoff`` is pending for the current generation,
no member joins it (the daemon retires its generation and waits); the drained worker offers what
it holds, its successor copies it, and the one who reports (the successor, or the
drained worker in a shrink) puts its result in every heartbeat until the
coordinator ends the handoff (:mod:`collectives_server.worker.transport.handoff` says how
the tensors move). When the handoff has ended, both reopen their stores, and a
worker the Cluster lists as DRAINING (drained, the handoff completed) stops: its
process exits 0, so its supervisor starts it again and it registers as a spare.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from collectives.errors import CollectiveError
from collectives.v1 import coordinator_pb2
from collectives.wire.names import FUNCTION_PREFIX
from collectives.wire.security import ChannelSecurity
from collectives_server.membership_digest import membership_digest
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.engine.generation import Generation
from collectives_server.worker.engine.groups_ahead import AheadKey, GroupsAhead
from collectives_server.worker.transport.handoff import HandoffCopy, copy_from

__all__ = ["DrainRole", "drain_id", "pending_handoff", "preparing_handoff"]

log = logging.getLogger(__name__)

# The successor's copy may take this many op timeouts (the coordinator's own
# deadline, 4 op timeouts by default, calls the drain off first when shorter).
_COPY_OP_TIMEOUTS = 4
# After the seal, the drained worker waits at most this long for the backward of a
# forward that reached it after it said it was ready.
_LATE_GRAPH_WAIT_S = 2.0


def pending_handoff(cluster: coordinator_pb2.Cluster) -> coordinator_pb2.Handoff | None:
    """The handoff nobody may join the current generation before, if any."""
    if not cluster.formed or not cluster.HasField("handoff"):
        return None
    handoff = cluster.handoff
    return handoff if handoff.generation_after == cluster.generation else None


def preparing_handoff(cluster: coordinator_pb2.Cluster) -> coordinator_pb2.Handoff | None:
    """The drain that prepares the next generation, if any (the current one serves)."""
    if not cluster.formed or not cluster.HasField("handoff"):
        return None
    handoff = cluster.handoff
    if handoff.preparing and handoff.generation_after == cluster.generation + 1:
        return handoff
    return None


def drain_id(handoff: coordinator_pb2.Handoff) -> str:
    """One drain's name, the same on every worker (a drain called off and asked again is
    another drain)."""
    return f"{handoff.generation_after}/{handoff.drained_id}/{handoff.drain_id}"


class DrainRole:
    """What this worker does about the drain in progress (called with the daemon's lock)."""

    def __init__(
        self,
        ctx: WorkerContext,
        peer_security: ChannelSecurity,
        wake_heartbeat: Callable[[], None],
        on_drained: Callable[[], None],
    ) -> None:
        self._ctx = ctx
        self._peer_security = peer_security
        self._wake_heartbeat = wake_heartbeat
        self._on_drained = on_drained
        self._lock = threading.Lock()
        self._generation_after = 0  # the handoff this worker is taking part in (0: none)
        self._result: coordinator_pb2.HandoffResult | None = None
        self._bytes_copied = 0  # while copying, as the successor
        # The copy, as the successor, until the coordinator says the drain completed:
        # installed then (settle), dropped if it was called off.
        self._staged: tuple[int, HandoffCopy] | None = None
        self.drained = False  # drained and the handoff completed: this worker stops
        self.ahead = GroupsAhead()  # the next generation's groups, while a drain prepares it
        self._preparing = 0  # the generation a drain prepares, this worker taking part
        self._preparing_drain: str | None = None  # which drain (drain_id)
        # Ready to switch to it: (generation, membership digest), said in the heartbeats.
        self._prepared: tuple[int, str] = (0, "")
        # The successor's copy ahead, until the seal's copy takes what did not change.
        self._ahead_copy: tuple[int, HandoffCopy] | None = None
        # The drained worker: the graphs whose backward it stopped waiting for while
        # the drain prepared (their clients hold them without a backward).
        self._graphs_left: frozenset[str] = frozenset()

    @property
    def result(self) -> coordinator_pb2.HandoffResult | None:
        """What to report in the next heartbeat, if anything."""
        with self._lock:
            return self._result

    @property
    def bytes_copied(self) -> int:
        """While this worker copies a handoff as the successor: the bytes so far."""
        with self._lock:
            return self._bytes_copied if self._generation_after or self._preparing else 0

    @property
    def prepared(self) -> tuple[int, str]:
        """The generation a drain prepares that this worker is ready for, and its
        membership digest ((0, ""): none)."""
        with self._lock:
            return self._prepared

    def prepare(
        self,
        handoff: coordinator_pb2.Handoff,
        cluster: coordinator_pb2.Cluster,
        connect_store: Callable[[str], dist.Store],
        host: str | None,
    ) -> None:
        """While ``handoff`` prepares its generation (once per generation): the drained
        worker offers what it holds to the copy ahead, and says it is ready once no
        forward's graph there awaits its backward; a member of that generation forms
        its groups ahead (through ``connect_store`` of the store it meets at), the
        successor also takes the copy ahead; then each says it is ready."""
        generation, drain = handoff.generation_after, drain_id(handoff)
        with self._lock:
            if self._preparing_drain == drain:
                return
            self._preparing, self._preparing_drain = generation, drain
            self._prepared, self._ahead_copy = (0, ""), None
            self._graphs_left = frozenset()
        me = self._ctx.worker_id
        members = sorted((w for w in cluster.workers if w.rank >= 0), key=lambda w: w.rank)
        planned = [w.worker_id for w in members]
        if not 0 <= handoff.rank < len(planned):
            return
        planned[handoff.rank] = handoff.successor_id
        digest = membership_digest(planned)
        if me == handoff.drained_id:
            self._ctx.handoff.offer_ahead(generation, self._ctx.store.contents(), drain)
            threading.Thread(
                target=self._ready_once_graphs_end,
                args=(generation, drain, digest),
                name="handoff-graphs",
                daemon=True,
            ).start()
            return
        if me not in planned or not handoff.store_address:
            return
        key = AheadKey(generation, digest, planned.index(me), len(planned), handoff.drain_id)
        waiting = {"groups", "copy"} if me == handoff.successor_id else {"groups"}

        def done(part: str) -> None:
            with self._lock:
                if self._preparing_drain != drain:
                    return
                waiting.discard(part)
                if waiting:
                    return
                self._prepared = (generation, key.membership_digest)
            log.info("drain: ready for generation %d (prepared ahead)", generation)
            self._wake_heartbeat()

        address = handoff.store_address
        self.ahead.form(
            key,
            lambda: connect_store(address),
            self._ctx.op_timeout_s,
            self._ctx.device,
            host,
            lambda: done("groups"),
        )
        if "copy" in waiting:
            threading.Thread(
                target=self._copy_ahead,
                args=(handoff, lambda: done("copy")),
                name="handoff-ahead",
                daemon=True,
            ).start()

    def _copy_ahead(self, handoff: coordinator_pb2.Handoff, done: Callable[[], None]) -> None:
        """The successor, while the drain prepares: copy what the drained worker holds
        now; after the seal only what changed since moves (a failed copy ahead: all)."""
        generation = handoff.generation_after
        copied = copy_from(
            handoff.drained_address,
            generation,
            self._peer_security,
            _COPY_OP_TIMEOUTS * self._ctx.op_timeout_s,
            on_bytes=self._copied,
            ahead=True,
        )
        if copied.error:
            log.warning("drain: the copy ahead failed (all moves after the seal): %s", copied.error)
            done()
            return
        this_drain = drain_id(handoff)

        def still_preparing() -> bool:
            with self._lock:
                return self._preparing_drain == this_drain

        with self._lock:
            if self._preparing_drain == this_drain:
                self._ahead_copy = (generation, copied)
        log.info(
            "drain: copied %d tensors (%d bytes) ahead in %.3f s",
            len(copied.tensors),
            copied.nbytes,
            copied.seconds,
        )
        built = self._ctx.built_ahead.build(
            copied.model_builds,
            copied.archives,
            self._ctx.uploads,
            self._ctx.models.allowed_factories,
            still_preparing,
        )
        if built:
            log.info("drain: built models %s ahead", built)
        done()

    def _ready_once_graphs_end(self, generation: int, drain: str, digest: str) -> None:
        """The drained worker, while its drain prepares: ready to switch once no forward's
        graph here awaits its backward (a graph cannot move; the gradients its backward
        leaves move with the rank). Clients hold new forwards with autograd while a
        drain prepares, so the graphs end as their backwards come; one a client holds
        without a backward delays the seal until the drain's preparation bound."""
        left = self._ctx.models.await_graphs_ended(self._ctx.op_timeout_s)
        with self._lock:
            if self._preparing_drain != drain:
                return
            self._prepared = (generation, digest)
            self._graphs_left = frozenset(left)
        if left:
            log.warning(
                "drain: %d forwards' graphs still await their backward after %g s; "
                "their backward will fail once the rank is handed over",
                len(left),
                self._ctx.op_timeout_s,
            )
        log.info("drain: ready for generation %d (no graph awaits its backward)", generation)
        self._wake_heartbeat()

    def _copied(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_copied = nbytes

    def take_part(self, handoff: coordinator_pb2.Handoff, retired: Generation | None) -> None:
        """Starts this worker's part in ``handoff`` (once); ``retired`` is the generation
        it ran until now, whose last op must end before the drained worker's store closes."""
        with self._lock:
            self._preparing, self._preparing_drain, self._prepared = 0, None, (0, "")
            if self._generation_after == handoff.generation_after:
                return
            self._generation_after = handoff.generation_after
        me = self._ctx.worker_id
        if me == handoff.drained_id:
            target = self._offer
        elif me == handoff.successor_id:
            what = f"rank {handoff.rank} is being handed over from {handoff.drained_address}"
            self._ctx.store.close_for_handoff(f"{what}; retry shortly", hold=True)
            target = self._copy
        else:
            return
        threading.Thread(
            target=target, args=(handoff, retired), name="handoff", daemon=True
        ).start()

    def settle(self, cluster: coordinator_pb2.Cluster) -> None:
        """After the handoff ended (no handoff pending for the current generation)."""
        me = next((w for w in cluster.workers if w.worker_id == self._ctx.worker_id), None)
        drained = me is not None and me.state == coordinator_pb2.WORKER_STATE_DRAINING
        with self._lock:
            took_part, self._generation_after, self._result = self._generation_after, 0, None
            prepared, self._preparing, self._preparing_drain = self._preparing, 0, None
            self._bytes_copied, self._prepared = 0, (0, "")
            self._graphs_left = frozenset()
            staged, self._staged = self._staged, None
            self._ahead_copy = None
        self.ahead.drop()  # (formed for a drain called off while it prepared)
        if prepared and not took_part:  # called off before the seal: the offer goes
            self._ctx.handoff.withdraw()
            self._ctx.built_ahead.clear()
        if staged is not None:
            self._install_if_completed(cluster, *staged)
        if drained:
            # Its store stays closed: a client with an older view must not write here.
            if not self.drained:
                self.drained = True
                log.info("drained: the rank was handed over; this worker stops")
                self._on_drained()
            return
        if took_part:  # ended: as the successor, or called off as the drained one
            self._ctx.handoff.withdraw()
            self._ctx.store.reopen()

    def _install_if_completed(
        self, cluster: coordinator_pb2.Cluster, generation_after: int, copied: HandoffCopy
    ) -> None:
        """The successor's copy becomes its store only if the coordinator recorded the
        drain as completed onto this worker; a drain called off leaves nothing behind
        (a stale copy of another rank's tensors would make later ops mean something else)."""
        completed = any(
            r.successor_id == self._ctx.worker_id
            and r.generation_after == generation_after
            and not r.error
            for r in cluster.drains
        )
        if not completed:
            log.warning("drain: called off; the copied tensors are dropped")
            return
        self._ctx.store.install(copied.tensors)
        # The models come from the peers as this worker joins; their gradients and
        # running statistics, the drained rank's own, are set once each is hosted
        # (engine.model_sync).
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for (model, key), grad in copied.gradients.items():
            pending.setdefault(model, {})[key] = grad
        self._ctx.handoff_gradients.clear()
        self._ctx.handoff_gradients.update(pending)
        log.info(
            "drain: installed %d tensors (and %d models' gradients) for generation %d",
            len(copied.tensors),
            len(pending),
            generation_after,
        )

    def _offer(self, handoff: coordinator_pb2.Handoff, retired: Generation | None) -> None:
        """The drained worker: once its last op ended, and the backward of each forward
        that reached it since it said it was ready, close the store and offer it."""
        wait_s = self._ctx.op_timeout_s
        if retired is not None and not retired.wait_ended(wait_s):
            log.error(
                "drain: the retired generation's op did not end within %g s; offering "
                "nothing, so the drain is called off and this worker keeps its rank",
                wait_s,
            )
            return
        with self._lock:
            known = self._graphs_left
        # (From a client whose view had not shown the drain yet: its backward is a
        # training step away, and every op of the cluster waits for the switch meanwhile.)
        late = self._ctx.models.await_graphs_ended(_LATE_GRAPH_WAIT_S, but=known) - known
        if late:
            log.warning(
                "drain: %d forwards that came after the drain prepared still await their "
                "backward after %g s; handing the rank over without them",
                len(late),
                _LATE_GRAPH_WAIT_S,
            )
        to = handoff.successor_address or "nobody (the cluster shrinks)"
        with self._lock:  # (settle, which ends the handoff, takes it too)
            if self._generation_after != handoff.generation_after:
                return  # called off while the last op ran: the store stays open
            self._ctx.store.close_for_handoff(
                f"this worker was drained: rank {handoff.rank} now belongs to {to}; retry"
            )
            tensors = self._ctx.store.contents()
            self._ctx.handoff.offer(handoff.generation_after, tensors, self._rank_state())
        log.info("drain: offering %d tensors to %s", len(tensors), to)
        if not handoff.successor_id:
            self._report(
                coordinator_pb2.HandoffResult(
                    generation_after=handoff.generation_after, ok=True, lost=sorted(tensors)
                )
            )

    def _rank_state(self) -> dict[tuple[str, str], torch.Tensor]:
        """A copy of what of every hosted model is this rank's own, by (model, key): its
        parameters' gradients until a reduction (a client's backward not yet
        all-reduced), and the buffers of a model that keeps running statistics (each
        rank's train-mode calls move its own). The peers send the rest."""
        out = {}
        for model in self._ctx.models.all():
            if model.name.startswith(FUNCTION_PREFIX):
                continue
            with model.lock:
                for key, param in model.parameters:
                    if param.grad is not None:
                        out[(model.name, key)] = param.grad.detach().clone()
                if model.running_statistics:
                    for key, buffer in model.module.named_buffers():
                        out[(model.name, key)] = buffer.detach().clone()
        return out

    def _copy(self, handoff: coordinator_pb2.Handoff, retired: Generation | None) -> None:
        """The successor: copy everything (what changed since the copy ahead, if it took
        one), stage it (all or nothing), report."""
        with self._lock:
            ahead, self._ahead_copy = self._ahead_copy, None
        if ahead is not None and ahead[0] != handoff.generation_after:
            ahead = None
        copied = copy_from(
            handoff.drained_address,
            handoff.generation_after,
            self._peer_security,
            _COPY_OP_TIMEOUTS * self._ctx.op_timeout_s,
            on_bytes=self._copied,
            reuse=ahead[1] if ahead is not None else None,
        )
        if ahead is not None and not copied.error:  # the transfer's time: both copies
            copied = dataclasses.replace(copied, seconds=copied.seconds + ahead[1].seconds)
        result = copied.result(handoff.generation_after)
        if not copied.error:
            try:
                self._ctx.store.check_fits(copied.tensors)
            except CollectiveError as err:
                result.ok, result.error = False, str(err)
        if result.ok:
            # Installed (and the store reopened) once the coordinator has ended the
            # handoff: until then the drain may still be called off (settle).
            with self._lock:
                if self._generation_after == handoff.generation_after:
                    self._staged = (handoff.generation_after, copied)
            log.info(
                "drain: took rank %d with %d tensors (%d bytes; %d kept from the copy ahead) "
                "in %.3f s",
                handoff.rank,
                result.tensors,
                result.bytes,
                copied.kept,
                result.seconds,
            )
        else:
            log.error("drain: the handoff failed: %s", result.error)
        self._report(result)

    def _report(self, result: coordinator_pb2.HandoffResult) -> None:
        with self._lock:
            if self._generation_after != result.generation_after:
                return  # the handoff ended meanwhile
            self._result = result
        self._wake_heartbeat()
