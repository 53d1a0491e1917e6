"""``Cluster``'s operator part: the flight record (``cluster.flight_record``).

It reads every rank's flight recorder through the session's cached channels
and merges the answers by op (``collectives.flight_record``).
"""

from __future__ import annotations

from collections.abc import Iterable

from collectives.errors import InvalidArgument, Unavailable
from collectives.observe.flight_record import OpRecord, read_flight_record
from collectives.session.connection import Session

__all__ = ["Operations"]


class Operations:
    """What an operator asks of a running cluster: which op ran where, and when."""

    def __init__(self, session: Session) -> None:
        self._session = session

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
