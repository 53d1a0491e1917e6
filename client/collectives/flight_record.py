"""The cluster's flight record, as ``cluster.flight_record()`` returns it.

:class:`OpRecord` (one op, merged across ranks by its generation and op id)
and :class:`RankPhases` (that op on one rank: when it reached each phase)
are defined with the code that reads and merges the ranks' records in
``collectives.observe.flight_record``.
"""

from __future__ import annotations

from collectives.observe.flight_record import OpRecord, RankPhases
from collectives.wire.op_phases import PHASES

__all__ = ["PHASES", "OpRecord", "RankPhases"]
