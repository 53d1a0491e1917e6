"""The flight recorder under ops that name thousands of long names.

The ring was bounded in entries, not bytes: a coalesced all_reduce of 1,024
missing 250-character names fails at once but was recorded whole (its
descriptor, and a message naming every missing tensor), so 120 of them grew
each worker by about 100 MiB, and every reader of the ring (`flight_record()`,
`collectives trace`, `collectives diagnose`) then failed "Sent message larger
than max". Each record is now bounded and says what it left out, and readers
page, so the ring stays readable whatever it holds.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import wait_until
from hostile import rss_bytes

import collectives

MiB = 1 << 20
pytestmark = pytest.mark.timeout(240)


def _missing_names(round_: int) -> list[str]:
    return [f"missing/{round_}/{i:04d}/" + "x" * 230 for i in range(1024)]


def test_ops_naming_a_thousand_long_names_keep_the_ring_small_and_readable(
    fresh_cluster,
) -> None:
    local, client = fresh_cluster(2)
    workers = [w for w in client.workers() if w.rank >= 0]
    for round_ in range(4):  # the allocator's caches fill up first
        with pytest.raises(collectives.NotFound):
            client.all_reduce(_missing_names(round_), timeout=30)
    before = {w.rank: rss_bytes(w.pid) for w in workers}
    for round_ in range(4, 124):
        with pytest.raises(collectives.NotFound):
            client.all_reduce(_missing_names(round_), timeout=30)
    grown = {w.rank: (rss_bytes(w.pid) - before[w.rank]) / MiB for w in workers}
    assert all(g < 32 for g in grown.values()), f"grew {grown} MiB over 120 failed ops"

    # Every reader still reads the whole ring. (The leader answers an op before the
    # other rank may have closed its record of it: the last op's merged record can
    # read as still running for a moment.)
    def failed_ops() -> list:
        records = client.flight_record(last=2000, timeout=60)
        return [r for r in records if r.kind == "all_reduce_coalesced" and r.outcome == "NOT_FOUND"]

    failed = wait_until(
        lambda: found if len(found := failed_ops()) == 124 else None,
        30,
        "the 124 failed ops recorded as failed on every rank",
    )
    for record in failed:
        assert len(record.names) == 16 and record.names_omitted == 1024 - 16
        assert record.names[0].startswith("missing/")
    for command in (["trace", "--last", "2000", "--json"], ["diagnose"]):
        run = subprocess.run(
            [sys.executable, "-m", "collectives.cli.main", *command, "--timeout", "30",
             "--coordinator", local.address],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert "larger than max" not in run.stderr, run.stderr
        assert run.returncode in (0, 1), (command, run.returncode, run.stderr)
        if command[0] == "trace":
            assert run.stdout.count('"NOT_FOUND"') >= 124, run.stdout[:2000]
