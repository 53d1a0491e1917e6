"""``--log-format json``: the daemons log one JSON object per line; with
``--log-level DEBUG`` each op is a line carrying its ids, and a failed op is a
WARNING on the leader with the same ids, so a client's error can be found."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import wait_until

import collectives

REQUIRED = {"time", "level", "logger", "message", "pid"}


def _records(path) -> list[dict]:
    """Every JSON line of the launcher's stderr (children's included); other lines
    (C++ libraries writing to stderr directly) are skipped."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))  # a line that starts like JSON must be JSON
    return records


@pytest.mark.timeout(180)
def test_json_logs_carry_op_ids(fresh_cluster):
    local, cluster = fresh_cluster(2, "--log-format", "json", "--log-level", "DEBUG")
    cluster.put("logged", torch.ones(4, 4))
    cluster.all_reduce("logged")
    with pytest.raises(collectives.NotFound) as failed:
        cluster.all_reduce("not-there")
    generation = cluster.generation

    def op_lines():
        records = _records(local.log_path)
        ok = [r for r in records if r.get("kind") == "all_reduce" and r.get("code") == "OK"]
        bad = [r for r in records if r.get("kind") == "all_reduce" and r.get("code") == "NOT_FOUND"]
        return (records, ok, bad) if len(ok) >= 2 and len(bad) >= 2 else None

    records, ok, bad = wait_until(op_lines, 15, "op lines from both workers")
    for r in records:
        assert r.keys() >= REQUIRED, r
        assert r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), r
    assert {r["role"] for r in records} >= {"local", "coordinator", "worker"}

    # One DEBUG line per rank for the successful op, with its ids and sizes.
    assert len({r["pid"] for r in ok}) == 2, ok
    for r in ok:
        assert r["level"] == "DEBUG" and r["logger"] == "collectives_server.worker.ops", r
        assert r["op_id"] > 0 and r["generation"] == generation, r
        assert r["tensor"] == "logged" and r["ranks"] == [0, 1], r
        assert r["bytes"] == 4 * 4 * 4 and r["latency_s"] >= 0, r
    assert len({r["op_id"] for r in ok}) == 1  # the same op on both ranks

    # The failure: a WARNING on the leader, with the op id the others carry too.
    warnings = [r for r in bad if r["level"] == "WARNING"]
    assert len(warnings) == 1, bad
    warning = warnings[0]
    assert warning["op_id"] == ok[0]["op_id"] + 1 and warning["generation"] == generation
    client_message = failed.value.message
    assert "'not-there'" in warning["message"] and "'not-there'" in client_message
    op_in_client = re.search(r"\bop (\d+)\b", client_message)
    if op_in_client:  # the op id the client saw finds the line
        assert int(op_in_client.group(1)) == warning["op_id"], (client_message, warning)
    assert {r["op_id"] for r in bad} == {warning["op_id"]}

    # Data-plane calls are logged too.
    puts = [r for r in records if r.get("kind") == "put" and r.get("tensor") == "logged"]
    assert len(puts) == 2, puts
