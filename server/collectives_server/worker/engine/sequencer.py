"""The leader's op queue for one generation: admission, order, ticks. Pure logic.

torch.distributed needs every rank to issue the same collectives in the same
order; concurrent clients cannot guarantee that, so the leader admits every op
into one bounded FIFO and announces them one by one. This class holds that
FIFO and its rules and nothing else: no threads, no process group, a clock
passed in, so every rule is unit-tested with a fake clock
(``tests/unit/test_sequencer.py``). The generation loop (``generation``) wraps
it with a condition variable and does the announcing; it asks this class what
to do next (:meth:`Sequencer.loop_next`) and waits as told.

Rules:

* **Bound to a generation.** An op names the generation its client saw
  (0: whatever is current). It is admitted only into that generation, and it
  runs there or not at all: when the generation ends, queued ops fail with
  ``UNAVAILABLE`` naming both generations and saying nothing was committed.
* **Bounded.** A full queue refuses with ``RESOURCE_EXHAUSTED`` at once.
* **Deadlines.** An op whose deadline passed while it waited is dropped, never
  started, with ``DEADLINE_EXCEEDED`` (the client has given up on it).
* **Ticks.** When nothing was announced for ``tick_s``, a no-op is due: it
  keeps followers inside their receive timeout and proves the group alive.
* **Claims.** While the loop is parked with nothing to do, the submitter of
  an op that is all that is queued may claim it and run it on its own thread
  (``Generation.run_claimed``); one claim at a time, only while an epoch is
  open, and the loop waits for it to be released. A claimed op that breaks the
  group ends the epoch: the loop, next asking, gets an :class:`EpochEnd`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from collectives.errors import (
    CollectiveError,
    DeadlineExceeded,
    Reason,
    ResourceExhausted,
    Unavailable,
)
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import kind_name

__all__ = ["EpochEnd", "Park", "Sequencer", "Ticket"]


@dataclass(eq=False)
class Ticket:
    """One admitted op: its descriptor (op id and generation filled in) and its outcome."""

    desc: worker_pb2.OpDescriptor
    deadline: float
    future: Future = field(default_factory=Future)
    started: bool = False
    # The submitting thread runs this op itself (``Generation.run_claimed``).
    claimed: bool = False
    admitted: float = 0.0  # the sequencer's clock when it was admitted
    client: str = ""  # the peer that issued it, for the flight recorder

    def fail(self, error: CollectiveError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(frozen=True)
class EpochEnd:
    """A claimed op ended the epoch (its group broke, or a bug): why, for the loop to
    rebuild the group, or None when the generation was retired meanwhile."""

    failure: str | None


@dataclass(frozen=True)
class Park:
    """Nothing for the loop to announce yet: it waits ``seconds`` for a submit, or,
    with None, until the claimed op is released."""

    seconds: float | None


class Sequencer:
    def __init__(
        self,
        generation: int,
        capacity: int,
        tick_s: float,
        clock: Callable[[], float] = time.monotonic,
        membership_digest: str = "",
    ) -> None:
        self.generation = generation
        self.membership_digest = membership_digest
        self.capacity = capacity
        self.tick_s = tick_s
        self._clock = clock
        self._queue: collections.deque[Ticket] = collections.deque()
        self._next_op_id = 1
        self._last_announced = clock()
        self.closed_because: str | None = None
        # Who runs the next op: the generation loop, or, while the loop is parked
        # with nothing queued, the submitter of a small op (``claim``).
        self.loop_parked = False
        self.claimed = False  # a submitter runs an op: the loop waits for it
        self.claims_open = False  # an epoch runs ops (its group is formed)
        self.epoch_end: EpochEnd | None = None  # a claimed op ended the epoch

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self.closed_because is not None

    def admit(
        self,
        desc: worker_pb2.OpDescriptor,
        timeout_s: float,
        expected_generation: int = 0,
        expected_digest: str = "",
    ) -> Ticket:
        """Queues ``desc``; raises if the generation is over, not the one (or not the
        membership) the client expected, or the queue is full. Assigns the op id,
        the generation and its membership digest."""
        self.check_generation(expected_generation, expected_digest)
        if self.closed:
            raise Unavailable(
                f"generation {self.generation} is over ({self.closed_because}); "
                "refresh the cluster and retry",
                executed=False,
                generation=self.generation,
                reason=Reason.GENERATION_CHANGED,
            )
        if len(self._queue) >= self.capacity:
            raise ResourceExhausted(
                f"the leader's op queue is full ({self.capacity} ops); retry later",
                executed=False,
                generation=self.generation,
                reason=Reason.QUEUE_FULL,
            )
        desc.op_id = self._next_op_id
        desc.generation = self.generation
        desc.membership_digest = self.membership_digest
        self._next_op_id += 1
        now = self._clock()
        ticket = Ticket(desc, now + timeout_s, admitted=now)
        self._queue.append(ticket)
        return ticket

    def may_claim(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s submitter may run it on its own thread (two thread
        hand-offs fewer): only while the loop is parked, no other submitter runs
        one, and ``ticket`` is all that is queued."""
        alone = len(self._queue) == 1 and self._queue[0] is ticket
        idle = self.loop_parked and not self.claimed and self.claims_open
        return idle and not self.closed and alone

    def claim(self, ticket: Ticket) -> bool:
        """Claims ``ticket`` for its submitter when :meth:`may_claim`; the loop then
        waits until :meth:`release`."""
        if self.may_claim(ticket):
            self.claimed = ticket.claimed = True
        return ticket.claimed

    def release(self) -> bool:
        """The claimed op is done; returns whether the loop must wake (it is not
        parked, or ops, a close or the epoch's end are waiting for it)."""
        self.claimed = False
        waiting = bool(self._queue) or self.closed or self.epoch_end is not None
        return not self.loop_parked or waiting

    def open_epoch(self) -> None:
        """The loop formed a group: ops may be claimed until :meth:`close_epoch`."""
        self.claims_open, self.epoch_end = True, None

    def close_epoch(self) -> None:
        """The loop's epoch is over: no more claims."""
        self.claims_open = False

    def end_epoch(self, failure: str | None) -> None:
        """A claimed op ended the epoch (``failure``: why, None when retired): nothing
        is claimed again in it, and the loop is told by :meth:`loop_next`."""
        self.claims_open = False
        self.epoch_end = EpochEnd(failure)

    def loop_next(self) -> Ticket | Park | EpochEnd | None:
        """What the loop does next: wait (:class:`Park`: while an op is claimed, or
        until a tick is due), end the epoch a claimed op ended, run the next op
        (marked started), or, with None, announce a tick (a stop once closed)."""
        if self.claimed:
            return Park(None)
        if self.epoch_end is not None:
            return self.epoch_end
        if self.closed:
            return None
        ticket = self.next()
        if ticket is not None:
            return ticket
        wait = self.tick_in()
        return Park(wait) if wait > 0 else None

    def check_generation(self, expected: int, expected_digest: str = "") -> None:
        """Raises UNAVAILABLE unless ``expected`` is 0 or this generation, and
        ``expected_digest`` is "" or this generation's membership digest."""
        if expected_digest and expected_digest != self.membership_digest:
            raise Unavailable(
                f"membership mismatch: the request was for generation {expected or '?'} with "
                f"membership {expected_digest}, but this leader's group is generation "
                f"{self.generation} with membership {self.membership_digest or 'none'}; "
                "nothing was run. Refresh the cluster and reissue it",
                executed=False,
                generation=expected or self.generation,
                reason=Reason.GENERATION_CHANGED,
            )
        if expected and expected != self.generation:
            raise Unavailable(
                f"generation changed: the request was for generation {expected}, "
                f"the cluster is at {self.generation}; nothing was run. Refresh the cluster "
                "and reissue it if its operands are still placed as intended",
                executed=False,
                generation=expected,
                reason=Reason.GENERATION_CHANGED,
            )

    def cancel(self, ticket: Ticket) -> bool:
        """Drops a queued op; False if it already started (it runs to its end)."""
        if ticket.started:
            return False
        if ticket in self._queue:
            self._queue.remove(ticket)
        return True

    def next(self) -> Ticket | None:
        """The next op to announce (marked started), or None when none is queued.
        Ops whose deadline passed while queued are failed and skipped."""
        ticket = self.peek()
        if ticket is not None:
            self.take(ticket)
        return ticket

    def peek(self) -> Ticket | None:
        """The op :meth:`next` would return, left queued. Ops whose deadline passed
        while queued are failed and dropped."""
        now = self._clock()
        while self._queue and not self.closed:
            ticket = self._queue[0]
            if now < ticket.deadline:
                return ticket
            self._queue.popleft()
            ticket.fail(
                DeadlineExceeded(
                    f"op {ticket.desc.op_id} ({kind_name(ticket.desc.kind)}) did not start "
                    f"before its deadline (queue depth {len(self._queue)}); it was dropped",
                    executed=False,
                    generation=self.generation,
                    op_id=ticket.desc.op_id,
                    reason=Reason.TIMEOUT,
                )
            )
        return None

    def take(self, ticket: Ticket) -> bool:
        """Starts ``ticket`` if it is still at the head of the queue (from :meth:`peek`)."""
        if self.closed or not self._queue or self._queue[0] is not ticket:
            return False
        self._queue.popleft()
        ticket.started = True
        return True

    def tick_in(self) -> float:
        """Seconds until an idle tick is due (<= 0: due now)."""
        return self._last_announced + self.tick_s - self._clock()

    def announced(self) -> None:
        """Records that something (an op or a tick) was just announced."""
        self._last_announced = self._clock()

    def drain(self, why: str, reason: Reason = Reason.PEER_LOST) -> list[Ticket]:
        """Fails and returns every queued op (none had started); admission stays open."""
        queued = list(self._queue)
        self._queue.clear()
        for ticket in queued:
            ticket.fail(
                Unavailable(
                    f"op {ticket.desc.op_id} ({kind_name(ticket.desc.kind)}) of generation "
                    f"{self.generation} did not start: {why}; nothing was committed",
                    executed=False,
                    generation=self.generation,
                    op_id=ticket.desc.op_id,
                    kind=kind_name(ticket.desc.kind),
                    reason=reason,
                )
            )
        return queued

    def close(self, reason: str, successor: int | None = None) -> list[Ticket]:
        """Ends admission for good; fails and returns every queued op."""
        if successor is not None:
            reason = f"superseded by generation {successor}"
        if self.closed_because is None:
            self.closed_because = reason
        why = f"generation {self.generation} ended ({self.closed_because})"
        return self.drain(why, Reason.GENERATION_CHANGED)
