"""``Cluster``'s operator part: the flight record (``cluster.flight_record``) and
drains (``cluster.drain``).

It reads every rank's flight recorder through the session's cached channels
and merges the answers by op (``collectives.flight_record``); a drain is one call
to the coordinator (``collectives.session.drains``).
"""

from __future__ import annotations

from collections.abc import Iterable

from collectives._validation import check_timeout
from collectives.errors import InvalidArgument, Unavailable
from collectives.observe.flight_record import OpRecord, read_flight_record
from collectives.session import drains
from collectives.session.connection import Session
from collectives.wire.cluster_state import DrainReport

__all__ = ["Operations"]


class Operations:
    """What an operator asks of a running cluster: which op ran where, and when."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def drain(
        self, worker: str, *, shrink: bool = False, timeout: float | None = None
    ) -> DrainReport:
        """Hands ``worker``'s rank to a live spare, with everything it holds.

        The coordinator seals the next generation with the spare in that rank.
        Before any member joins it, the spare copies every tensor the worker holds
        straight from it (worker to worker; every dtype and size, shared-memory
        and streamed ones included) and installs them all at once, or none; the
        spare gets every model (its newest version, mode, batching and optimizer
        state) from its peers as any joining worker does, with the drained
        worker's own gradients (a backward not yet reduced), and the groups made
        before the drain keep their ids and ranks. Ops ordered before the
        change ran on the old member; ops sent for the old generation that never
        ran there are sent again by the SDK on the new one (the operands are
        where they were placed), so callers see results, not errors. Meanwhile
        forwards without autograd (``dp(x)`` under ``torch.no_grad()``, placed by
        load) and :meth:`models` do not wait for the spare: they run on the members
        the drain does not involve. The drained worker then exits 0: its
        supervisor starts it again and it registers as the next spare.

        With no spare live the drain is refused, unless ``shrink``: then the
        rank leaves, the survivors re-form, and the report lists the tensor names
        lost with it. A crash is not a drain: ops it breaks fail as before. A
        drain of a worker whose drain is already running (asked by another
        client, a preStop hook, the worker's own SIGTERM) returns that drain's
        report.

        Args:
            worker: the member's address or worker id, as :meth:`workers` lists it.
            shrink: with no live spare, let the rank leave instead of refusing.
                Defaults to ``False``.
            timeout: seconds the handoff may take before the drain is called off
                (the rank then stays where it was); None means 4 op timeouts.
                Defaults to ``None``.

        Returns:
            A ``DrainReport``: worker, rank, successor, bytes and tensors moved,
            models the successor got, seconds, generations before and after, and
            the names lost (shrink only).

        Raises:
            InvalidArgument: ``worker`` is empty, or ``timeout`` is not positive.
            NotFound: no live worker is ``worker``.
            FailedPrecondition: it is not a member, the cluster is not formed,
                a drain of another worker is running, or no spare is live (without
                ``shrink``).
            CollectiveError: code ``ABORTED``: the handoff failed or lost a worker
                it needed (with the drained worker live, its rank went back to it).
            DeadlineExceeded: the handoff did not end within ``timeout`` (a drain
                already running when this call came is left to the call that
                started it).
        """
        self._session.check_open()
        if timeout is not None:
            timeout = check_timeout(timeout, 0.0)
        report = drains.drain(
            self._session.coordinator,
            worker,
            shrink=shrink,
            timeout=timeout,
            op_timeout_s=self._session.snapshot().op_timeout_s,
        )
        self._session.refresh()
        return report

    def flight_record(
        self, last: int = 100, ranks: Iterable[int] | None = None, timeout: float | None = None
    ) -> list[OpRecord]:
        """The last ``last`` ops of every rank's flight recorder, merged by op.

        Every worker keeps a bounded ring of the ops it ran
        (``--flight-recorder-ops N``, default 2000; 0 turns it off): every op the
        leader sequenced, publishes, forwards and model ops included, with the
        time each reached each phase on that rank: ``admitted`` (leader),
        ``announced``, ``started`` (operands agreed, data moving) and
        ``finished``. The leader sequences every op, so one op has one
        ``(generation, op_id)`` on every rank.

        A forward (a share of a ``dp(x)`` call, which each worker runs on its own,
        not sequenced) is a record too: kind ``"forward"``, ``op_id`` 0 and its
        ``call_id``, the same on every rank that ran a share; it has no
        ``announced`` phase, ``admitted`` is when its call arrived and ``started``
        when it began to run. A record is bounded whatever the op named: it keeps
        an op's first 16 names (``names_omitted`` counts the rest) and the first
        1,024 characters of a message; the workers answer in pages of a few MiB,
        read back to back, so every ring can be read whole.

        Args:
            last: how many of the most recent ops of every rank (0: all the rings
                hold). Defaults to ``100``.
            ranks: read only these ranks (None: every member). Defaults to ``None``.
            timeout: seconds for the coordinator and for each rank's answer (a
                rank answers a large ring in pages, all within it); None means
                ``default_timeout_s``. Defaults to ``None``.

        Returns:
            One ``collectives.OpRecord`` per op, oldest first: ``op_id``,
            ``generation``, ``kind``, ``names``, ``nbytes`` (the largest result a
            rank reported), ``ranks`` (its group), ``client`` (the peer that
            issued it, as the leader saw it), ``outcome`` (``"ok"``,
            ``"in flight"``, or a status code name such as ``"FAILED_PRECONDITION"``),
            ``slowest_rank`` (the straggler: the rank the others waited for, the
            last to start the op's data phase; None until two ranks started it)
            and ``per_rank``: rank -> ``collectives.RankPhases`` with ``phases``
            (Unix seconds by phase), that rank's ``outcome``, ``message``,
            ``nbytes`` and ``dtype``. A rank that does not answer within
            ``timeout`` is absent from ``per_rank``.

        Raises:
            InvalidArgument: ``last`` is negative, or ``ranks`` names a non-member.
            Unavailable: the coordinator, or every rank asked, could not be reached.
        """
        if last < 0:
            raise InvalidArgument(f"last must be >= 0, got {last}")
        self._session.check_open()
        timeout = timeout if timeout is not None else self._session.default_timeout_s
        snapshot = self._session.refresh(timeout)
        wanted = None if ranks is None else sorted(set(ranks))
        members = {w.rank for w in snapshot.workers if w.rank >= 0}
        if wanted is not None and not set(wanted) <= members:
            missing = sorted(set(wanted) - members)
            raise InvalidArgument(f"ranks {missing} are not members of generation "
                                  f"{snapshot.generation} (ranks {sorted(members)})")  # fmt: skip
        record = read_flight_record(
            snapshot,
            lambda address: self._session.endpoint(address).channel,
            last=last,
            ranks=wanted,
            timeout=timeout,
        )
        if record.replies and all(r.reply is None for r in record.replies):
            why = "; ".join(f"rank {r.rank}: {r.error}" for r in record.replies)
            raise Unavailable(f"no rank answered for its flight record ({why})")
        return list(record.ops)
