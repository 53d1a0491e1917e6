"""Membership and generations of a cluster, as pure decisions.

The coordinator's only hard job is deciding who is in the cluster and when a new
*generation* (one fixed membership: rank -> worker) is sealed. That decision lives
here, apart from gRPC and from the clock, in the style of torchft's
``quorum_compute(now, state, opt)``: every event method takes ``now`` (seconds on
a monotonic clock, supplied by the caller), updates the state and returns an
:class:`Outcome` whose ``reason`` says what happened and why, so tests can drive
the state machine with an injected clock and assert on the reasons.

Rules (docs: ARCHITECTURE.md, "Membership, failure, time"):

* The first generation is sealed once ``min_workers`` live workers registered and
  ``join_window_s`` passed since the last registration, or at once when
  ``max_workers`` registered. Ranks follow registration order.
* A worker silent for more than ``lease_s`` is LOST; ``leave`` removes one at once.
  Silence is counted while the coordinator itself runs: given ``pause_s`` (the
  daemon's, whose ticker decides several times a second), two decisions further
  apart than that are a pause of its own (the process stopped, starved or frozen
  by its host, its workers' heartbeats waiting unread), and every live worker's
  lease starts again, so a pause of the coordinator never evicts the workers it
  could not hear.
  When a member is gone and survivors plus waiting newcomers still number at least
  ``min_workers``, generation g+1 is sealed at once: survivors in their old rank
  order, then newcomers in registration order, capped at ``max_workers``.
  Otherwise the cluster is *not formed* (nobody holds a rank) until enough workers
  are live again; the generation number stays until the next seal.
* A formed cluster below ``max_workers`` takes live newcomers in after the join
  window, sealing g+1.
* The generation changes on membership changes only; ``version`` increases on every
  change visible in the Cluster message except heartbeat ages and uptimes.
* LOST workers stay listed (rank -1) for dashboards: the newest
  :data:`LOST_KEEP_COUNT`, for at most :data:`LOST_KEEP_S` seconds. A LOST worker
  never comes back under its id: it must register again and joins as a newcomer.
* Each heartbeat may carry the worker's status (opaque here) with a *key*: the
  status without the fields that change all the time (memory). A heartbeat whose
  key differs from the last one published bumps ``version`` at once; otherwise the
  status is stored (GetCluster shows it) and published with the worker's next
  change, or after ``status_refresh_s`` at the latest.
* A *drain* hands a member's rank to a spare with everything it holds; its rules
  are in :mod:`.drain_rules` (a base of :class:`Membership`).
* The last :data:`HISTORY_LEN` sealed generations are kept (time, size, members,
  reason), and ``events`` counts workers joined, lost and left, for metrics.
* One generation number names one membership: only :meth:`Membership._seal`
  assigns a generation its members, and only a *deciding* membership seals. A
  standby's copy of the leader's state (``deciding=False``, see
  :mod:`.membership_state`) takes no events and never runs the decision, so it
  shows exactly the membership the leader recorded. Each sealed generation
  carries the digest of its ordered member ids (``membership_digest``).

Cost: a heartbeat is O(log N) (N workers): leases sit in a heap by last
heartbeat (``worker_records.LeaseHeap``); the generation decision, which scans
every worker, runs only after an event that can change it or when the passage of
time can (the join window ending, a LOST worker ageing out); the status text comes
from counts kept up to date.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from collectives_server.coordinator.drain_rules import DRAINS_KEPT, PREPARE_MAX_S, DrainRules
from collectives_server.coordinator.vocabulary import (
    ClusterView,
    DrainReport,
    Handoff,
    InvalidRequestError,
    Outcome,
    SealedGeneration,
    UnknownWorkerError,
    WorkerState,
    WorkerView,
)
from collectives_server.coordinator.worker_records import (
    LOST_KEEP_COUNT,
    LOST_KEEP_S,
    LeaseHeap,
    WorkerRecord,
    check_limits,
    plural,
    prune_lost,
    status_text,
    unknown_message,
    validate_registration,
    worker_row,
)
from collectives_server.membership_digest import membership_digest

__all__ = [
    "HISTORY_LEN",
    "LOST_KEEP_COUNT",
    "STATUS_REFRESH_S",
    "LOST_KEEP_S",
    "ClusterView",
    "InvalidRequestError",
    "Membership",
    "Outcome",
    "UnknownWorkerError",
    "WorkerState",
    "WorkerView",
]

# Sealed generations kept for Cluster.history.
HISTORY_LEN = 50
# A worker's status whose only changes are memory readings is published this often.
STATUS_REFRESH_S = 10.0


class Membership(DrainRules):
    """The registry of workers and the generation they form. Not thread-safe.

    ``id_prefix`` makes worker ids unique across coordinator restarts (a worker
    holding an id from a previous coordinator is told NOT_FOUND, not mistaken for a
    newer one); ``initial_version`` starts versions above any a previous coordinator
    handed out, so a client re-opening WatchCluster still gets the new state."""

    def __init__(
        self,
        min_workers: int,
        max_workers: int,
        *,
        lease_s: float = 5.0,
        join_window_s: float = 0.5,
        id_prefix: str = "w",
        initial_version: int = 1,
        status_refresh_s: float = STATUS_REFRESH_S,
        deciding: bool = True,
        pause_s: float | None = None,
        prepare_s: float = PREPARE_MAX_S,
    ) -> None:
        check_limits(min_workers, max_workers, lease_s, join_window_s)
        # How long a drain may prepare its generation (at most half its timeout); 0: it
        # seals at once (see drain_rules).
        self.prepare_s = prepare_s
        # A longer gap between two decisions is a pause of this coordinator's own (see
        # the module); None: none is (a caller that moves the clock by hand).
        self.pause_s = pause_s
        # False for a standby's read-only copy: events raise, no decision runs.
        self.deciding = deciding
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.lease_s = lease_s
        self.join_window_s = join_window_s
        self.status_refresh_s = status_refresh_s
        self._id_prefix = id_prefix
        self.sealer = ""  # recorded as each generation's sealed_by (the coordinator's address)
        self._history: collections.deque[SealedGeneration] = collections.deque(maxlen=HISTORY_LEN)
        # Workers "joined" (new registrations), "lost" (lease ran out, replaced), "left";
        # also "drains_failed" and "coordinator_pauses" (see _expire).
        self.events: collections.Counter[str] = collections.Counter()
        self._workers: dict[str, WorkerRecord] = {}
        self._next_order = 0
        self._last_registration: float | None = None
        self._generation = 0
        self._members: list[str] = []  # current generation's ranks; survivors when not formed
        self._formed = False
        self._digest = ""  # membership_digest of _members while formed
        # >= 1 so that WatchCluster(after_version=0) gets the first state at once.
        self._version = max(1, initial_version)
        self._status = ""
        self._newly_lost: list[str] = []  # since the last _finish
        # (last heartbeat, order, worker id), one entry per renewal; an entry whose
        # time is no longer its worker's last heartbeat is stale and skipped.
        self._leases = LeaseHeap()
        # The time of the last decision (see _expire and pause_s).
        self._decided_at: float | None = None
        # What the passage of time alone can change, as of the last full decision
        # (see _time_changes_decision): the join window still running, and the
        # oldest LOST worker, which ages out of the listing.
        self._window_running = False
        self._oldest_lost_at: float | None = None
        # Counts the status text and `ready` need, kept up to date so neither scans:
        # workers not LOST, and members of the generation that joined its process group.
        self._live_n = 0
        self._member_set: frozenset[str] = frozenset()
        self._joined_n = 0
        # The drain in progress, the last drains' reports, and totals.
        self._handoff: Handoff | None = None
        self._drains: collections.deque[DrainReport] = collections.deque(maxlen=DRAINS_KEPT)
        self._handoff_losses: list[str] = []  # workers the pending handoff lost
        # Set by _seal, taken by _finish (which records the generation in the history).
        self._just_sealed = False
        self._sealed_carried_over = False
        self._sealed_ahead = ""  # the drain whose groups formed ahead the seal takes
        self.drains_completed = 0
        self.drain_bytes_total = 0
        self._status = self._compute_status()

    # ---- read side -------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def version(self) -> int:
        return self._version

    @property
    def formed(self) -> bool:
        return self._formed

    @property
    def status(self) -> str:
        return self._status

    def is_live(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is registered and not LOST (its heartbeats are accepted)."""
        return self._live(worker_id) is not None

    def live_worker_at(self, address: str) -> str | None:
        """The id of the live worker registered at ``address``, if any."""
        return next(
            (w.worker_id for w in self._workers.values() if w.address == address and not w.lost),
            None,
        )

    @property
    def waiting(self) -> int:
        """Live workers that the next generation has no room for (beyond ``max_workers``)."""
        return max(0, self._live_count() - self.max_workers)

    def listed(self) -> tuple[str, ...]:
        """Ids of every worker listed in the Cluster message (live and LOST)."""
        return tuple(self._workers)

    @property
    def members(self) -> tuple[str, ...]:
        """Worker ids by rank; empty while the cluster is not formed."""
        return tuple(self._members) if self._formed else ()

    @property
    def ready(self) -> bool:
        # (A drain that still prepares leaves the current generation serving.)
        handoff = self._handoff
        return self._formed and self._joining() == 0 and (handoff is None or handoff.preparing)

    @property
    def handoff(self) -> Handoff | None:
        """The drain in progress, if any."""
        return self._handoff

    @property
    def drains(self) -> tuple[DrainReport, ...]:
        """The last drains' reports, oldest first."""
        return tuple(self._drains)

    def view(self, now: float) -> ClusterView:
        members = self.members
        gen = self._generation
        rows = [worker_row(self._workers[wid], rank, now, gen) for rank, wid in enumerate(members)]
        others = [w for w in self._workers.values() if w.worker_id not in members]
        others.sort(key=lambda w: (w.lost, w.lost_at or 0.0, w.order))
        full = self._formed and len(members) >= self.max_workers
        rows += [worker_row(w, -1, now, gen, full) for w in others]
        return ClusterView(
            generation=self._generation,
            formed=self._formed,
            world_size=len(members),
            workers=tuple(rows),
            version=self._version,
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            status=self._status,
            ready=self.ready,
            history=tuple(self._history),
            membership_digest=self._digest,
            handoff=self._handoff,
            handoff_addresses=self._handoff_addresses(),
            drains=tuple(self._drains),
            drains_completed=self.drains_completed,
            drain_bytes_total=self.drain_bytes_total,
        )

    @property
    def membership_digest(self) -> str:
        """The digest of the current generation's member ids; "" while not formed."""
        return self._digest

    # ---- events ----------------------------------------------------------------

    def register(
        self,
        now: float,
        *,
        address: str,
        hostname: str = "",
        pid: int = 0,
        devices: tuple[str, ...] | list[str] = (),
        backend: str = "",
        version: str = "",
        last_generation: int = 0,
        store_port: int = 0,
    ) -> tuple[str, Outcome]:
        """Adds a worker; returns its id. Raises :class:`InvalidRequestError`.

        A retried registration (same address, hostname and pid, still live) gets
        the same id back. A new process at a live worker's address replaces it:
        the old one cannot be serving there any more, so it is declared LOST.
        (Over gRPC, :class:`~.control.ControlGuard` refuses that case with
        ALREADY_EXISTS before it gets here, unless the caller proves it is a retry.)
        """
        self._check_deciding("register")
        devices = tuple(devices)
        validate_registration(address, devices)
        if last_generation > self._generation and not self._members:
            # A restarted coordinator: continue numbering above what workers
            # already joined, so generations never go backwards.
            self._generation = last_generation
        if not backend:
            backend = "nccl" if any(d.startswith("cuda") for d in devices) else "gloo"
        self._expire(now)
        notes: list[str] = []
        for w in self._workers.values():
            if w.lost or w.address != address or w.hostname != hostname:
                continue
            if w.pid == pid:
                self._leases.renew(w, now, self._workers)
                outcome = self._finish(now, False, f"{w.worker_id} registered again (retry)")
                return w.worker_id, outcome
            self._mark_lost(w, now)
            notes.append(f"{w.worker_id} at {address} replaced by pid {pid}")
        self._next_order += 1
        worker_id = f"{self._id_prefix}-{self._next_order}"
        self._workers[worker_id] = WorkerRecord(
            worker_id=worker_id,
            address=address,
            hostname=hostname,
            pid=pid,
            devices=devices,
            backend=backend,
            version=version,
            order=self._next_order,
            registered_at=now,
            last_heartbeat=now,
            store_port=store_port,
        )
        self._leases.renew(self._workers[worker_id], now, self._workers)
        self._live_n += 1
        self._last_registration = now
        self.events["joined"] += 1
        live = plural(self._live_count(), "live worker")
        notes.insert(0, f"registered {worker_id} at {address} ({live})")
        return worker_id, self._finish(now, True, "; ".join(notes))

    def heartbeat(
        self,
        now: float,
        worker_id: str,
        *,
        joined_generation: int = 0,
        busy: bool = False,
        status: Any = None,
        status_key: bytes | None = None,
        handoff_bytes_copied: int = 0,
        prepared_generation: int = 0,
        prepared_digest: str = "",
    ) -> Outcome:
        """Renews a lease. Raises :class:`UnknownWorkerError` for unknown or LOST ids.

        ``handoff_bytes_copied``: the successor of the pending handoff says how far its
        copy got (shown in the Cluster message; other workers' values are ignored).
        ``prepared_generation`` (and its ``prepared_digest``): a member of the
        generation a drain prepares is ready to switch to it (the last one ready seals
        it).

        ``status`` (with ``status_key``, see the module doc) replaces the worker's
        last reported status; None leaves it as it was.

        A ``joined_generation`` that is not a generation of this coordinator (a worker
        still counting from before a coordinator restart) counts as 0, "not joined":
        the lease is renewed all the same, so a confused worker is never declared lost
        for it, and the reason says so.
        """
        self._check_deciding("heartbeat")
        expired = self._expire(now)
        w = self._live(worker_id)
        if w is None:  # unknown, or its own lease ran out before this call arrived
            if expired:
                self._finish(now, True, "; ".join(expired))
            raise UnknownWorkerError(self._unknown_message(worker_id))
        self._leases.renew(w, now, self._workers)
        beat = f"heartbeat from {worker_id} (joined {joined_generation}, busy {busy})"
        if not 0 <= joined_generation <= self._generation:
            beat += f": generation {joined_generation} is unknown here, counted as 0"
            joined_generation = 0
        # Joining a generation's process group changes the status text and `ready`;
        # busy only changes this worker's row.
        rejoined = w.joined_generation != joined_generation
        changed = bool(expired) or rejoined or w.busy != busy
        if rejoined and worker_id in self._member_set:
            joined_before = w.joined_generation == self._generation
            self._joined_n += (joined_generation == self._generation) - joined_before
        w.joined_generation = joined_generation
        w.busy = busy
        h = self._handoff
        if h is not None and worker_id == h.successor and handoff_bytes_copied > h.bytes_copied:
            self._handoff = dataclasses.replace(h, bytes_copied=handoff_bytes_copied)
            changed = True
        all_prepared = bool(prepared_generation) and self.prepared(
            worker_id, prepared_generation, prepared_digest
        )
        if status is not None:
            published, note = w.take_status(now, status, status_key, self.status_refresh_s, changed)
            beat, changed = beat + note, changed or published
        reason = "; ".join([*expired, beat])
        if expired or all_prepared or self._time_changes_decision(now):
            return self._finish(now, changed, reason)
        if rejoined:
            changed = self._update_status() or changed
        return self._bump(changed, reason)

    def leave(self, now: float, worker_id: str) -> Outcome:
        """Removes a worker at once. Raises :class:`UnknownWorkerError`."""
        self._check_deciding("leave")
        expired = self._expire(now)
        w = self._live(worker_id)
        if w is None:
            if expired:
                self._finish(now, True, "; ".join(expired))
            raise UnknownWorkerError(self._unknown_message(worker_id))
        reasons = [*expired, f"{worker_id} at {w.address} left"]
        del self._workers[worker_id]
        self._live_n -= 1
        self.events["left"] += 1
        h = self._handoff
        if h is not None and worker_id in (h.drained, h.successor, *self._members):
            reasons.append(self._call_off(now, f"{worker_id} left during the handoff"))
        return self._finish(now, True, "; ".join(reasons))

    def crashed(self, now: float, worker_id: str, evidence: str) -> Outcome:
        """Marks a live worker LOST at once, without waiting for its lease: its process
        is known to be gone (``evidence`` says how). Nothing changes for a worker that
        is no longer live (it left, or was already lost)."""
        self._check_deciding("crashed")
        expired = self._expire(now)
        w = self._live(worker_id)
        reasons = list(expired)
        if w is not None:
            self._mark_lost(w, now)
            reasons.append(f"{worker_id} at {w.address} lost: {evidence}")
        if not reasons:
            return Outcome(changed=False, reason=f"{worker_id} was no longer live")
        return self._finish(now, True, "; ".join(reasons))

    def address_of(self, worker_id: str) -> str | None:
        """The address a live worker registered with (None: not live)."""
        w = self._live(worker_id)
        return None if w is None else w.address

    def tick(self, now: float) -> Outcome:
        """Applies the passage of time: lease expiry, the join window, pruning.

        A copy that does not decide (a standby's) ignores time: it changes only
        when the leader's next state replaces it."""
        if not self.deciding:
            return Outcome(changed=False, reason="tick")
        expired = self._expire(now)
        if not expired and not self._time_changes_decision(now):
            return Outcome(changed=False, reason="tick")
        return self._finish(now, bool(expired), "; ".join(expired) or "tick")

    def resume(self, now: float, reason: str) -> Outcome:
        """A new leader's first decision on a restored state (see :mod:`.membership_state`)."""
        self._check_deciding("resume")
        return self._finish(now, True, reason)

    # ---- decisions -------------------------------------------------------------

    def _check_deciding(self, event: str) -> None:
        if not self.deciding:
            raise RuntimeError(
                f"{event} on a membership copy that does not decide (a standby's): "
                "only the leader's membership takes events"
            )

    def _live(self, worker_id: str) -> WorkerRecord | None:
        w = self._workers.get(worker_id)
        return None if w is None or w.lost else w

    def _live_count(self) -> int:
        return self._live_n

    def _joining(self) -> int:
        """Members of the generation that have not joined its process group yet."""
        return len(self._members) - self._joined_n

    def _mark_lost(self, w: WorkerRecord, now: float) -> None:
        w.lost_at = now
        self._newly_lost.append(w.worker_id)
        self._live_n -= 1
        if self._handoff is not None and (
            w.worker_id in (self._handoff.drained, self._handoff.successor)
            or (w.worker_id in self._member_set)
        ):
            self._handoff_losses.append(w.worker_id)

    def _unknown_message(self, worker_id: str) -> str:
        return unknown_message(self._workers.get(worker_id), worker_id, self.lease_s)

    def _expire(self, now: float) -> list[str]:
        """Marks workers whose lease ran out as LOST; the reasons, in registration order.
        After a pause of this coordinator's own, every live lease starts again instead."""
        last, self._decided_at = self._decided_at, max(now, self._decided_at or now)
        if self.pause_s is not None and last is not None and now - last > self.pause_s:
            for w in self._workers.values():
                if not w.lost:
                    self._leases.renew(w, now, self._workers)
            self.events["coordinator_pauses"] += 1
            return []
        reasons = []
        for w in self._leases.due(now, self.lease_s, self._workers):
            self._mark_lost(w, now)
            reasons.append(
                f"{w.worker_id} at {w.address} lost: no heartbeat for "
                f"{now - w.last_heartbeat:.2f} s (lease {self.lease_s:g} s)"
            )
        return reasons

    def _time_changes_decision(self, now: float) -> bool:
        """Whether time alone, since the last full decision, can change its result.

        Only two rules depend on the clock without an event: the join window
        ending (a seal), and a LOST worker ageing out of the listing (pruning).
        Everything else changes through register, leave, expiry or a worker
        joining a generation, which always run the full decision.
        """
        last = self._last_registration
        if self._window_running and last is not None and now - last >= self.join_window_s:
            return True
        h = self._handoff
        if h is not None and (now >= h.deadline or (h.preparing and now >= h.prepare_by)):
            return True
        oldest = self._oldest_lost_at
        return oldest is not None and now - oldest > LOST_KEEP_S

    def _update_status(self) -> bool:
        """Recomputes the status text (O(1)); True if it changed."""
        status = self._compute_status()
        if status == self._status:
            return False
        self._status = status
        return True

    def _bump(self, changed: bool, reason: str) -> Outcome:
        """The outcome of an event that cannot change the generation decision or status text."""
        if changed:
            self._version += 1
        return Outcome(changed=changed, reason=reason)

    def _finish(self, now: float, changed: bool, reason: str) -> Outcome:
        """Runs the generation decision after an event and bumps ``version`` if visible.
        A generation the event sealed itself (a drain, one called off) counts as sealed."""
        assert self.deciding, "only a deciding membership runs the generation decision"
        if self._handoff is not None:
            why = self._handoff_trouble(now)
            if why:
                reason = f"{reason}; {self._call_off(now, why)}"
                changed = True
            elif self._handoff.preparing:
                sealing = self._seal_prepared(now)
                if sealing:
                    reason, changed = f"{reason}; {sealing}", True
        self._handoff_losses = []
        if self._handoff is None:
            _, decision = self._decide(now)
        else:
            decision = ""  # nothing else is decided while a handoff runs
        sealed, self._just_sealed = self._just_sealed, False
        changed = prune_lost(self._workers, now) or changed or sealed
        self._settle(now)
        changed = self._update_status() or changed
        if decision:
            reason = f"{reason}; {decision}"
        if sealed and (not self._history or self._history[-1].generation != self._generation):
            self._history.append(
                SealedGeneration(
                    generation=self._generation,
                    sealed_at=now,
                    world_size=len(self._members),
                    members=tuple(self._workers[m].address for m in self._members),
                    reason=reason,
                    sealed_by=self.sealer,
                    membership_digest=self._digest,
                    carried_over=self._sealed_carried_over,
                    formed_ahead=self._sealed_ahead,
                )
            )
        if changed:
            self._version += 1
        lost, self._newly_lost = tuple(self._newly_lost), []
        if lost:
            self.events["lost"] += len(lost)
        return Outcome(changed=changed, reason=reason, sealed=sealed, lost=lost)

    def _settle(self, now: float) -> None:
        """Recomputes what is derived from the state (counts, digest, what time can
        change); decides nothing. Run after every decision and after a restore."""
        self._member_set = frozenset(self._members)
        self._joined_n = sum(
            1 for m in self._members if self._workers[m].joined_generation == self._generation
        )
        self._digest = membership_digest(self._members) if self._formed else ""
        self._window_running = (
            self._last_registration is not None
            and now - self._last_registration < self.join_window_s
        )
        lost_times = [w.lost_at for w in self._workers.values() if w.lost_at is not None]
        self._oldest_lost_at = min(lost_times, default=None)

    def _decide(self, now: float) -> tuple[bool, str]:
        live_members = [m for m in self._members if self._live(m) is not None]
        member_set = set(live_members)
        newcomers = sorted(
            (
                w
                for w in self._workers.values()
                if not w.lost and not w.drained and w.worker_id not in member_set
            ),
            key=lambda w: w.order,
        )
        candidates = live_members + [w.worker_id for w in newcomers]
        window_passed = (
            self._last_registration is None or now - self._last_registration >= self.join_window_s
        )
        if self._formed:
            gone = len(self._members) - len(live_members)
            if gone:
                if len(candidates) >= self.min_workers:
                    return True, self._seal(
                        candidates, f"{plural(gone, 'member')} gone, {len(live_members)} survive"
                    )
                self._formed = False
                self._members = live_members
                return False, (
                    f"generation {self._generation} broken: {plural(gone, 'member')} gone, "
                    f"{len(candidates)} live < min {self.min_workers}"
                )
            if newcomers and len(self._members) < self.max_workers and window_passed:
                return True, self._seal(candidates, f"{plural(len(newcomers), 'newcomer')} joined")
            return False, ""
        self._members = live_members
        if len(candidates) >= self.max_workers or (
            len(candidates) >= self.min_workers and window_passed
        ):
            at_max = len(candidates) >= self.max_workers
            why = "max_workers reached" if at_max else "join window passed"
            return True, self._seal(candidates, why)
        return False, ""

    def _seal(self, candidates: list[str], why: str, *, carried_over: bool = False) -> str:
        self._just_sealed = True
        self._sealed_carried_over = carried_over
        self._sealed_ahead = ""
        self._generation += 1
        self._members = candidates[: self.max_workers]
        self._formed = True
        ranks = ", ".join(f"{r}={wid}" for r, wid in enumerate(self._members))
        return f"sealed generation {self._generation} ({why}): {ranks}"

    def _compute_status(self) -> str:
        return status_text(
            formed=self._formed,
            generation=self._generation,
            live=self._live_count(),
            members=len(self._members),
            joining=self._joining() if self._formed else 0,
            min_workers=self.min_workers,
            max_workers=self.max_workers,
        )
