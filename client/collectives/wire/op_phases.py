"""The phases of an op, defined once: what every rank stamps, what a trace draws.

Every reader of a flight record (the SDK's ``flight_record()``, ``collectives
trace`` and ``diagnose``, a worker's phase histograms and stuck verdict, the
dashboard's timeline, which gets these as ``phases.js``) takes them from here.

Phases, in the order a rank reaches them (a phase not reached has no time):

- ``admitted``: the leader queued the op (the leader only; a forward: its RPC arrived);
- ``announced``: sent to the group, or received from the leader;
- ``started``: this rank's handler began (operands agreed, data moving);
- ``finished``: committed or failed here.

The proto's ``FlightRecordOp`` carries one ``<phase>_s`` field per phase.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DOING", "PHASES", "SPANS", "phases_of", "stamp_fields"]

PHASES = ("admitted", "announced", "started", "finished")

# The spans between phases a trace draws and the histograms time:
# (name, the phase it starts at, the phase it ends at).
SPANS = (
    ("queued", "admitted", "announced"),
    ("announced", "announced", "started"),
    ("running", "started", "finished"),
)

# What an op in flight is doing once it reached a phase (before ``finished``).
DOING = {
    "admitted": "queued on the leader",
    "announced": "announced, waiting to start",
    "started": "data phase",
}


def phases_of(op: Any) -> dict[str, float]:
    """Phase → seconds of a ``FlightRecordOp`` (or anything with ``<phase>_s``
    attributes), the phases reached only."""
    return {p: float(s) for p in PHASES if (s := getattr(op, f"{p}_s"))}


def stamp_fields(phases: Mapping[str, float]) -> dict[str, float]:
    """The ``<phase>_s`` fields of a ``FlightRecordOp`` for ``phases`` (0.0: not reached)."""
    return {f"{p}_s": phases.get(p, 0.0) for p in PHASES}
