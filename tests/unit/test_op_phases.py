"""An op's phases are defined once (``collectives.wire.op_phases``); every reader takes
them from there, the dashboard's JavaScript included (served as ``phases.js``)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

from collectives.observe.trace_events import TRACKS
from collectives.v1 import flight_record_pb2
from collectives.wire.op_phases import PHASES, SPANS, phases_of, stamp_fields
from collectives_server.coordinator.dashboard.server import phases_js

ROOT = Path(__file__).resolve().parents[2]
DEFINITION = ROOT / "client" / "collectives" / "wire" / "op_phases.py"


def test_no_source_spells_the_phases_out_but_their_definition() -> None:
    """A list of two phase names in a row is a definition: only op_phases holds one."""
    pattern = re.compile(
        r"""["'](admitted|announced|started)["']\s*,\s*["'](announced|started|finished)["']"""
    )
    sources = [
        *ROOT.glob("client/collectives/**/*.py"),
        *ROOT.glob("server/collectives_server/**/*.py"),
    ]
    sources += list(ROOT.glob("server/collectives_server/**/*.js"))
    found = [
        str(p.relative_to(ROOT))
        for p in sources
        if "_pb2" not in p.name and p != DEFINITION and pattern.search(p.read_text())
    ]
    assert found == []


def test_the_proto_has_one_stamp_field_per_phase() -> None:
    fields = {f.name for f in flight_record_pb2.FlightRecordOp.DESCRIPTOR.fields}
    assert {f"{p}_s" for p in PHASES} <= fields
    op = flight_record_pb2.FlightRecordOp(**stamp_fields({"admitted": 1.5, "started": 2.5}))
    assert phases_of(op) == {"admitted": 1.5, "started": 2.5}


def test_spans_join_consecutive_phases_and_are_the_trace_tracks() -> None:
    assert [(begin, end) for _, begin, end in SPANS] == list(itertools.pairwise(PHASES))
    assert list(TRACKS.values()) == list(SPANS)


def test_the_dashboard_gets_them_from_the_definition() -> None:
    text = phases_js()
    table = json.loads(text[text.index("freeze(") + len("freeze(") : text.rindex(")")])
    assert table == {"phases": list(PHASES), "spans": [list(s) for s in SPANS]}
