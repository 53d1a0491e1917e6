"""The leader's run scheduling: which ops run together, on which thread, and when
their clients hear of it.

The sequencer (``sequencer``) holds the queue and its rules as pure logic; this
is its threaded side, what the generation loop and a claiming submitter ask for
a *run* (one op, or ops that run fused: ``fusion``):

* :meth:`RunSchedule.next_run`: the loop's next run. It waits as the sequencer
  says (parked until a submit or a tick is due, or while a submitter runs a
  claimed op), and answers the last run's clients before it parks; None means
  a tick is due (a stop once the generation is closed).
* :meth:`RunSchedule.claimed_run`: the run of a submitter that claimed its op
  (``Generation.run_claimed``), taken as the loop would have taken it.
* :func:`set_outcomes`: a run's outcomes set, waking each client's RPC thread. The
  loop sets a run's outcomes together once the next run is announced (or before
  it parks): their threads then take the GIL while the loop waits for the
  followers, not before its announcement. A run cut short is answered at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from collectives.errors import CollectiveError
from collectives.v1 import worker_pb2
from collectives_server.worker.engine import fusion
from collectives_server.worker.engine.sequencer import EpochEnd, Park, Sequencer, Ticket

__all__ = ["Answer", "RunSchedule", "ScheduledRun", "set_outcomes"]

# A ticket and the outcome its client gets (a result, or a CollectiveError).
Answer = tuple[Ticket, object]
# The leader's tickets of a run, and the run (its ops and their inline capacities).
ScheduledRun = tuple[list[Ticket], fusion.Run]
# The inline capacity of an op's operands (``tensor_ops.inline_capacity``).
InlineOf = Callable[[worker_pb2.OpDescriptor], int | None]


def set_outcomes(answers: list[Answer]) -> None:
    """Sets each ticket's outcome (waking its client's thread) and empties ``answers``."""
    for ticket, outcome in answers:
        if isinstance(outcome, CollectiveError):
            ticket.future.set_exception(outcome)
        else:
            ticket.future.set_result(outcome)
    answers.clear()


class RunSchedule:
    """The runs of one generation's leader, over its sequencer and condition."""

    def __init__(self, seq: Sequencer, cond: threading.Condition) -> None:
        self._seq = seq
        self._cond = cond

    def next_run(
        self, inline_of: InlineOf, unanswered: list[Answer]
    ) -> ScheduledRun | EpochEnd | None:
        """The loop's next run; the end of the epoch (a claimed op ended it); or None
        when a tick is due or the generation is stopping. The last run's
        ``unanswered`` clients are answered before the loop parks."""
        first = self._wait_for_op(unanswered)
        if first is None or isinstance(first, EpochEnd):
            return first
        return self._run_from(first, inline_of)

    def claimed_run(self, inline_of: InlineOf) -> ScheduledRun | None:
        """A claiming submitter's run: its op and what fuses with it (None: the claimed
        op is gone, e.g. failed at its deadline or drained)."""
        with self._cond:
            first = self._seq.next()
        return None if first is None else self._run_from(first, inline_of)

    def _wait_for_op(self, unanswered: list[Answer]) -> Ticket | EpochEnd | None:
        while True:
            with self._cond:
                step = self._seq.loop_next()
                if not isinstance(step, Park):
                    return step
                if not unanswered:
                    if step.seconds is None:
                        self._cond.wait()
                        continue
                    self._seq.loop_parked = True
                    try:
                        self._cond.wait(step.seconds)
                    finally:
                        self._seq.loop_parked = False
                    continue
            set_outcomes(unanswered)

    def _run_from(self, first: Ticket, inline_of: InlineOf) -> ScheduledRun:
        """``first`` and the queued ops that can run fused with it (``fusion``)."""
        run, tickets = fusion.Run(), [first]
        inline = inline_of(first.desc)
        fusable = run.admits(first.desc, inline)
        run.add(first.desc, inline)
        while fusable:
            with self._cond:
                ticket = self._seq.peek()  # None once closed
            if ticket is None:
                break
            inline = inline_of(ticket.desc)
            if not run.admits(ticket.desc, inline):
                break
            with self._cond:
                if not self._seq.take(ticket):
                    break
            run.add(ticket.desc, inline)
            tickets.append(ticket)
        return tickets, run
