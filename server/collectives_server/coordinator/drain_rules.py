"""The drain rules of the membership: a rank handed over, and every way it ends.

A *drain* (:meth:`DrainRules.drain`) hands a member's rank to the first live
spare. It first *prepares* generation g+1 (the members with the spare in that
rank) without sealing it: g still serves while g+1's members form its groups
ahead and the spare copies ahead what the drained worker holds, and each reports
when it is ready (:meth:`DrainRules.prepared`). Once all are, or after
``prepare_s``, g+1 is sealed, and a *handoff* is pending: nobody should join g+1
until the successor reports that it copied the drained worker's tensors (what
changed since its copy ahead; :meth:`DrainRules.handoff_result`). Then g+1
is marked ``carried_over`` and the drained worker, excluded from every later
generation, leaves. With ``shrink`` and no spare, g+1 is sealed without the rank
and the drained worker reports what it held. A handoff that fails, runs out of
time, or loses a worker it needs is called off: while the drained worker is live
its rank goes back to it in g+2 (``carried_over`` when no other member was lost:
no op ran in g+1). While a handoff is pending no other decision is taken (losses
aside: :meth:`Membership._finish` calls it off first).

:class:`DrainRules` is a part of :class:`~.membership.Membership` (its base), kept
in a file of its own: it reads and changes the membership's state, and the
generation decision there consults the pending handoff.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
from typing import TYPE_CHECKING

from collectives_server.coordinator.vocabulary import (
    DrainRefusedError,
    DrainReport,
    Handoff,
    HandoffOutcome,
    Outcome,
    SealedGeneration,
)
from collectives_server.coordinator.worker_records import WorkerRecord, plural
from collectives_server.membership_digest import membership_digest

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["DRAINS_KEPT", "PREPARE_MAX_S", "DrainRules"]

# Drain reports kept for Cluster.drains.
DRAINS_KEPT = 20
# A drain's preparation (groups formed ahead, the copy ahead) may take at most this
# long by default (``--drain-prepare-s``), and half the drain's timeout, before its
# generation is sealed anyway (the workers then form and copy after the seal, as a
# worker that does not prepare does).
PREPARE_MAX_S = 10.0


class DrainRules:
    """Drains, handoffs and their reports; mixed into ``Membership``."""

    # The membership's state these rules read and change (Membership sets them).
    _workers: dict[str, WorkerRecord]
    _members: list[str]
    _member_set: frozenset[str]
    _generation: int
    _history: collections.deque[SealedGeneration]
    _formed: bool
    _status: str
    min_workers: int
    prepare_s: float
    events: collections.Counter[str]
    _handoff: Handoff | None
    _handoff_losses: list[str]
    _drains: collections.deque[DrainReport]
    drains_completed: int
    drain_bytes_total: int
    _check_deciding: Callable[[str], None]
    _expire: Callable[[float], list[str]]
    _finish: Callable[[float, bool, str], Outcome]
    _live: Callable[[str], WorkerRecord | None]
    _seal: Callable[..., str]
    _sealed_ahead: str

    def _handoff_addresses(self) -> tuple[str, str]:
        h = self._handoff
        if h is None:
            return ("", "")
        drained = self._workers.get(h.drained)
        successor = self._workers.get(h.successor) if h.successor else None
        return (
            drained.address if drained is not None else "",
            successor.address if successor is not None else "",
        )

    def drain(self, now: float, worker: str, *, shrink: bool = False, timeout_s: float) -> Outcome:
        """Starts handing ``worker``'s rank (its id or address) to the first live spare.

        Prepares the next generation, with the spare in that rank, and seals it once
        its members are ready (or after the preparation's bound); with ``shrink``
        and no spare, seals it without the rank at once. The handoff is called off
        if it has not ended within ``timeout_s``.

        Raises:
            DrainRefusedError: no such live worker (``not_found``); it is not a
                member, the cluster is not formed, a drain is in progress, or no
                spare is live and not ``shrink`` (``failed_precondition``).
        """
        self._check_deciding("drain")
        expired = self._expire(now)
        if expired:
            self._finish(now, True, "; ".join(expired))
        named = (x for x in self._workers.values() if worker in (x.worker_id, x.address))
        w = next((x for x in named if not x.lost), None)
        if w is None:
            raise DrainRefusedError("not_found", f"no live worker {worker!r} to drain")
        refusal = self._drain_refusal(w)
        if refusal:
            raise DrainRefusedError("failed_precondition", refusal)
        rank = self._members.index(w.worker_id)
        spares = self._spares()
        spare = spares[0] if spares else None
        if spare is None and not shrink:
            raise DrainRefusedError(
                "failed_precondition",
                f"no spare is live to take rank {rank} of {w.worker_id} at {w.address}: start "
                "one (collectives-server local --spares K, or a worker beyond --max-workers), "
                "or drain with shrink=True to let the rank leave",
            )
        if spare is None and len(self._members) - 1 < self.min_workers:
            raise DrainRefusedError(
                "failed_precondition",
                f"shrinking would leave {len(self._members) - 1} members, below "
                f"--min-workers {self.min_workers}",
            )
        before = self._generation
        held = w.status
        w.drained = True
        handoff = Handoff(
            drained=w.worker_id,
            successor=spare.worker_id if spare is not None else "",
            rank=rank,
            generation_before=before,
            generation_after=before + 1,
            started_at=now,
            deadline=now + timeout_s,
            total_tensors=int(held.tensors_held) if held is not None else 0,
            total_bytes=int(held.bytes_held) if held is not None else 0,
            drain_id=secrets.token_hex(8),
        )
        planned = list(self._members)
        if spare is None:
            candidates = [m for m in self._members if m != w.worker_id]
            why = f"drain of {w.worker_id} at {w.address} (rank {rank}), shrinking: no spare"
            decision = self._seal(candidates, why)
            self._handoff = dataclasses.replace(handoff, sealed_at=now)
            return self._finish(now, True, decision)
        planned[rank] = spare.worker_id
        if self.prepare_s <= 0:
            why = f"drain of {w.worker_id} at {w.address}: rank {rank} to spare {spare.worker_id}"
            decision = self._seal(planned, why)
            self._handoff = dataclasses.replace(handoff, sealed_at=now)
            return self._finish(now, True, decision)
        self._handoff = dataclasses.replace(
            handoff,
            preparing=True,
            planned=tuple(planned),
            prepare_by=now + min(self.prepare_s, timeout_s / 2),
        )
        return self._finish(
            now,
            True,
            f"drain of {w.worker_id} at {w.address}: preparing generation {before + 1} "
            f"with rank {rank} on spare {spare.worker_id}",
        )

    def prepared(self, worker_id: str, generation: int, digest: str) -> bool:
        """Notes that ``worker_id`` is ready to switch to ``generation`` of membership
        ``digest``, the one the pending drain prepares (a planned member: its groups
        formed ahead; the drained worker: no forward's graph awaits its backward
        there); whether this made every one of them ready."""
        h = self._handoff
        if (
            h is None
            or not h.preparing
            or generation != h.generation_after
            or digest != membership_digest(h.planned)
            or (worker_id not in h.planned and worker_id != h.drained)
            or worker_id in h.prepared
        ):
            return False
        self._handoff = dataclasses.replace(h, prepared=(*h.prepared, worker_id))
        return not _not_prepared(self._handoff)

    def _seal_prepared(self, now: float) -> str:
        """Seals the generation the pending drain prepares once every planned member and
        the drained worker are ready, or its bound passed; the decision ("" while it
        still prepares)."""
        h = self._handoff
        assert h is not None and h.preparing
        late = _not_prepared(h)
        if late and now < h.prepare_by:
            return ""
        complete = set(h.planned) <= set(h.prepared)  # every group formed ahead
        why = f"drain of {h.drained}: rank {h.rank} to spare {h.successor}" + (
            f" (not prepared in {h.prepare_by - h.started_at:g} s: {late})" if late else ""
        )
        decision = self._seal(list(h.planned), why)
        assert self._generation == h.generation_after, "a seal came between (decisions wait)"
        if complete:
            self._sealed_ahead = h.drain_id
        self._handoff = dataclasses.replace(
            h, preparing=False, formed_ahead=complete, sealed_at=now
        )
        return decision

    def _drain_refusal(self, w: WorkerRecord) -> str:
        if self._handoff is not None:
            h = self._handoff
            return (
                f"a drain is in progress (rank {h.rank} of {h.drained}, into generation "
                f"{h.generation_after}); drain one worker at a time"
            )
        if not self._formed:
            return f"the cluster is not formed ({self._status}): there is no rank to hand over"
        if w.worker_id not in self._member_set:
            return (
                f"{w.worker_id} at {w.address} is not a member (a spare or joining): "
                "it holds no rank"
            )
        return ""

    def _spares(self) -> list[WorkerRecord]:
        """Live workers outside the generation that may take a rank, in registration order."""
        return sorted(
            (
                w
                for w in self._workers.values()
                if not w.lost and not w.drained and w.worker_id not in self._member_set
            ),
            key=lambda w: w.order,
        )

    def handoff_result(self, now: float, worker_id: str, result: HandoffOutcome) -> Outcome:
        """Ends the pending handoff with what ``worker_id`` (its reporter) reported;
        a report for no pending handoff, or from another worker, changes nothing."""
        self._check_deciding("handoff_result")
        h = self._handoff
        if h is None or worker_id != h.reporter or result.generation_after != h.generation_after:
            return Outcome(changed=False, reason=f"stale handoff report from {worker_id}")
        if not result.ok:
            why = f"the handoff failed on {worker_id}: {result.error or 'no reason given'}"
            return self._finish(now, True, self._call_off(now, why))
        self._end_handoff(
            now,
            bytes_moved=result.bytes,
            tensors_moved=result.tensors,
            models_moved=0 if h.shrink else result.models,
            lost=result.lost,
            copy_seconds=result.seconds,
        )
        if not h.shrink:
            self._mark_carried_over(h.generation_after)
        self.drains_completed += 1
        self.drain_bytes_total += result.bytes
        what = (
            f"{plural(len(result.lost), 'tensor')} lost with the rank"
            if h.shrink
            else f"{plural(result.tensors, 'tensor')} ({result.bytes} bytes) moved"
        )
        return self._finish(now, True, f"drain of {h.drained} completed: {what}")

    def call_off_handoff(self, now: float, why: str) -> Outcome:
        """Calls the pending handoff off (its drain failed: ``why``); nothing if none."""
        self._check_deciding("call_off_handoff")
        if self._handoff is None:
            return Outcome(changed=False, reason="no handoff to call off")
        return self._finish(now, True, self._call_off(now, why))

    def _call_off(self, now: float, why: str) -> str:
        """Ends the pending handoff as failed. A live drained worker gets its rank back in
        a new generation (carried over: nobody joined the one that failed); a lost one's
        rank stays with its successor, empty, as after a crash. Returns the reason."""
        h = self._handoff
        assert h is not None
        drained = self._workers.get(h.drained)
        successor = self._workers.get(h.successor) if h.successor else None
        back = drained is not None and not drained.lost
        if h.preparing:  # nothing was sealed: the drained worker simply keeps its rank
            self._end_handoff(now, error=why)
            if drained is not None:
                drained.drained = False
            return f"drain of {h.drained} called off before its generation was sealed: {why}"
        if not back:
            why = (
                f"{why}; the drained worker is gone and rank {h.rank}'s tensors with it "
                "(the rank stays with its successor, empty, as after a crash)"
            )
        self._end_handoff(now, error=why)
        if not back:
            return f"drain of {h.drained} failed: {why}"
        assert drained is not None
        drained.drained = False
        # Carried over only when nobody else was lost meanwhile: every rank comes back.
        whole = len(self._members) + (1 if h.shrink else 0)
        members = [m for m in self._members if self._live(m) is not None]
        if h.shrink:
            members.insert(min(h.rank, len(members)), h.drained)
        elif successor is not None and h.successor in members:
            members[members.index(h.successor)] = h.drained
        else:
            members.insert(min(h.rank, len(members)), h.drained)
        carried = len(members) == whole
        if carried:
            self._mark_carried_over(h.generation_after)
        return self._seal(members, f"drain of {h.drained} called off ({why})", carried_over=carried)

    def _end_handoff(
        self,
        now: float,
        *,
        error: str = "",
        bytes_moved: int = 0,
        tensors_moved: int = 0,
        models_moved: int = 0,
        lost: tuple[str, ...] = (),
        copy_seconds: float = 0.0,
    ) -> None:
        h = self._handoff
        assert h is not None
        self._handoff = None
        drained = self._workers.get(h.drained)
        successor = self._workers.get(h.successor) if h.successor else None
        self._drains.append(
            DrainReport(
                worker=drained.address if drained is not None else "",
                worker_id=h.drained,
                rank=h.rank,
                successor=successor.address if successor is not None else "",
                successor_id=h.successor,
                generation_before=h.generation_before,
                generation_after=self._generation,
                seconds=max(0.0, now - h.started_at),
                finished_at=now,
                bytes_moved=bytes_moved,
                tensors_moved=tensors_moved,
                models_moved=models_moved,
                lost=lost,
                shrink=h.shrink,
                error=error,
                copy_seconds=copy_seconds,
                prepare_seconds=(now if h.sealed_at is None else h.sealed_at) - h.started_at,
                drain_id=h.drain_id,
            )
        )
        self.events["drains_failed" if error else "drains"] += 1

    def _mark_carried_over(self, generation: int) -> None:
        for i, record in enumerate(self._history):
            if record.generation == generation:
                self._history[i] = dataclasses.replace(record, carried_over=True)

    def _handoff_trouble(self, now: float) -> str:
        """Why the pending handoff must be called off now ("" while it may go on)."""
        h = self._handoff
        assert h is not None
        if self._handoff_losses:
            return f"{', '.join(self._handoff_losses)} lost during the handoff"
        if now >= h.deadline:
            return f"the handoff did not end within {h.deadline - h.started_at:g} s"
        return ""


def _not_prepared(h: Handoff) -> list[str]:
    """Who the drain still waits for before its seal: planned members not ready, and
    the drained worker while forwards' graphs there await their backward."""
    return sorted({*h.planned, h.drained} - set(h.prepared))
