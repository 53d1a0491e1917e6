"""``Cluster``'s operator part: the flight record (``cluster.flight_record``).

It reads every rank's flight recorder through the session's cached channels
and merges the answers by op (``collectives.flight_record``).
"""

from __future__ import annotations

from collections.abc import Iterable

from collectives._session import Session
from collectives.errors import InvalidArgument, Unavailable
from collectives.wire.flight_record import OpRecord, read_flight_record

__all__ = ["Operations"]


class Operations:
    """What an operator asks of a running cluster: which op ran where, and when."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def flight_record(
        self, last: int = 100, ranks: Iterable[int] | None = None, timeout: float | None = None
    ) -> list[OpRecord]:
        """The last ``last`` ops every rank recorded, merged by op; see ``Cluster``."""
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
