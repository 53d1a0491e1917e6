"""The flight recorder on real clusters: ``collectives diagnose`` names a stopped
rank and its op, ``collectives trace`` writes a valid Chrome trace of 1,000 mixed
ops from 4 clients that ``flight_record`` agrees with, and a rank made slow is
the straggler the records name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import metrics_endpoints, wait_until
from launcher import stop_process
from prometheus_client.parser import text_string_to_metric_families

import collectives

OP_TIMEOUT_S = 8.0
THRESHOLD_S = OP_TIMEOUT_S / 4
# A lease longer than the test: the stopped worker stays a member while stopped.
FLAGS = ("--op-timeout-s", str(OP_TIMEOUT_S), "--lease", "30")
PHASES = ("admitted", "announced", "started", "finished")


def _cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "collectives.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


def _members(cluster) -> list:
    return sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_diagnose_names_a_stopped_follower_and_its_op(fresh_cluster) -> None:
    local, cluster = fresh_cluster(3, *FLAGS)
    address = cluster.address
    assert _cli("diagnose", "--coordinator", address).returncode == 0
    for rank in range(3):
        cluster.put("fr/stuck", torch.full((4,), float(rank)), rank=rank)
    victim = _members(cluster)[2]
    assert local.owns(victim.pid), f"pid {victim.pid} is not one of this cluster's processes"
    stop_process(victim.pid)
    try:
        issued = time.monotonic()
        handle = cluster.all_reduce("fr/stuck", op="sum", async_op=True, timeout=60)
        verdict = None
        while time.monotonic() - issued < THRESHOLD_S + 2.0:
            begun = time.monotonic()
            run = _cli("diagnose", "--coordinator", address, "--timeout", "1")
            if run.returncode == 1:
                verdict = (begun - issued, run.stdout)
                break
            assert run.returncode == 0, run.stderr
        assert verdict is not None, (
            "diagnose did not say stuck within a quarter of the timeout + 2 s"
        )
        began_after, out = verdict
        assert began_after <= THRESHOLD_S + 2.0
        assert "all_reduce 'fr/stuck'" in out and "waiting on rank 2" in out, out
        assert "not answering" in out, out
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    handle.result(timeout=60)  # the op finishes once rank 2 resumes
    wait_until(
        lambda: _cli("diagnose", "--coordinator", address).returncode == 0,
        30,
        "diagnose to exit 0 after SIGCONT",
    )
    (op,) = [r for r in cluster.flight_record(last=20) if r.names == ("fr/stuck",)]
    assert op.outcome == "ok" and sorted(op.per_rank) == [0, 1, 2]
    assert f"op {op.op_id} all_reduce" in out


def _mixed_ops(address: str, client: int, ops: int, errors: list[BaseException]) -> None:
    try:
        with collectives.connect(address, timeout=60, name=f"fr-client-{client}") as c:
            name = f"fr/mixed/{client}"
            c.put(name, torch.ones(4))
            for i in range(ops):
                match i % 5:
                    case 0:
                        c.all_reduce(name)
                    case 1:
                        c.broadcast(name, src=i % 3)
                    case 2:
                        c.all_gather(name, out=f"{name}/gathered")
                    case 3:
                        c.barrier()
                    case _:
                        c.reduce(name, dst=i % 3)
    except BaseException as exc:  # handed to the test's thread
        errors.append(exc)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_trace_of_1000_mixed_ops_from_4_clients(fresh_cluster, tmp_path: Path) -> None:
    _, cluster = fresh_cluster(3)
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_mixed_ops, args=(cluster.address, c, 250, errors))
        for c in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    out = tmp_path / "trace.json"
    run = _cli("trace", "--coordinator", cluster.address, "--last", "2000", "--output", str(out))
    assert run.returncode == 0, run.stderr
    events = json.loads(out.read_text())["traceEvents"]

    # The schema: every event has ph, ts, pid, tid; every flow start has its end.
    assert all({"ph", "ts", "pid", "tid"} <= set(e) for e in events)
    starts = {e["id"] for e in events if e["ph"] == "s"}
    ends = {e["id"] for e in events if e["ph"] == "f"}
    assert starts == ends and starts

    # Every op on every rank of its group, with its phases in order.
    records = [r for r in cluster.flight_record(last=0) if r.kind != "noop"]
    ours = [
        r for r in records if any(n.startswith("fr/mixed/") for n in r.names) or r.kind == "barrier"
    ]
    assert len(ours) == 1000, len(ours)
    for r in records:
        assert sorted(r.per_rank) == sorted(r.ranks), r
        assert r.outcome == "ok", r
        for phases in r.per_rank.values():
            stamps = [phases.phases[p] for p in PHASES if p in phases.phases]
            assert stamps == sorted(stamps), (r.op_id, phases)
            assert {"announced", "started", "finished"} <= set(phases.phases)
        assert "admitted" in r.per_rank[0].phases and r.client
    # The trace holds the same ops, each on every rank of its group.
    running = {}
    for e in events:
        if e["ph"] == "X" and e["tid"] == 3:
            key = (e["args"]["generation"], e["args"]["op_id"])
            running.setdefault(key, set()).add(e["pid"])
    assert running == {(r.generation, r.op_id): set(r.ranks) for r in records}
    # --json prints the merged records.
    run = _cli("trace", "--coordinator", cluster.address, "--last", "5", "--json")
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    assert [(r["generation"], r["op_id"]) for r in printed] == [
        (r.generation, r.op_id) for r in records[-5:]
    ]
    assert all(set(r["per_rank"]) == {str(k) for k in r["ranks"]} for r in printed)


def test_diagnose_and_trace_exit_2_when_the_cluster_cannot_be_reached(tmp_path: Path) -> None:
    for args in (("diagnose",), ("trace", "--output", str(tmp_path / "t.json"))):
        run = _cli(*args, "--coordinator", "127.0.0.1:1", "--timeout", "2")
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        assert "cannot reach the coordinator" in run.stderr


def _stragglers(endpoints: list[str]) -> dict[str, float]:
    """rank -> collectives_op_straggler_total summed over every worker's /metrics."""
    counts: dict[str, float] = {}
    for address in endpoints:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "collectives_op_straggler":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        rank = sample.labels["rank"]
                        counts[rank] = counts.get(rank, 0.0) + sample.value
    return counts


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_made_slow_is_the_straggler(fresh_cluster) -> None:
    local, cluster = fresh_cluster(3, *FLAGS, "--metrics-port", "0")
    endpoints = wait_until(lambda: metrics_endpoints(local.log_path, 3), 30, "metrics endpoints")
    slow = _members(cluster)[1]
    assert local.owns(slow.pid)
    before = _stragglers(endpoints["worker"])
    names = []
    for i in range(3):
        name = f"fr/slow/{i}"
        # Past the inline bound: the op moves its data and the ranks agree on its outcome.
        cluster.put(name, torch.ones(1 << 18))
        names.append(name)
        stop_process(slow.pid)  # rank 1 reaches the op last
        try:
            handle = cluster.all_reduce(name, async_op=True, timeout=60)

            def started_elsewhere(name: str = name) -> bool:
                ops = cluster.flight_record(last=5, ranks=[0, 2], timeout=2)
                return any(
                    op.names == (name,)
                    and {0, 2} <= {r for r, p in op.per_rank.items() if "started" in p.phases}
                    for op in ops
                )

            wait_until(started_elsewhere, 30, f"ranks 0 and 2 in {name}")
        finally:
            os.kill(slow.pid, signal.SIGCONT)
        handle.result(timeout=60)
    records = {r.names: r for r in cluster.flight_record(last=20)}
    assert [records[(n,)].slowest_rank for n in names] == [1, 1, 1]
    after = _stragglers(endpoints["worker"])
    grew = {rank: after.get(rank, 0.0) - before.get(rank, 0.0) for rank in after}
    assert grew.get("1") == 3.0, grew
    assert grew.get("0", 0.0) == 0.0 and grew.get("2", 0.0) == 0.0, grew


def test_forwards_are_recorded_on_every_rank_that_ran_a_share(cluster2, gen, uname) -> None:
    """A data-parallel call is one record: its call id on both ranks, its outcome."""
    name = uname("mlp")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    cluster2.load_model(name, model, example_inputs=(torch.randn(2, 4),))
    dp = cluster2.data_parallel(name)
    with torch.no_grad():
        dp(torch.randn(6, 4, generator=gen))
        with pytest.raises(collectives.InvalidArgument):
            dp(torch.randn(6, 5, generator=gen))  # the wrong width: fails on both ranks
    forwards = [r for r in cluster2.flight_record(last=50) if r.kind == "forward"]
    mine = [r for r in forwards if r.names == (name,)]
    assert len(mine) == 2, forwards
    ok, failed = mine
    for record in mine:
        assert record.call_id and record.op_id == 0 and sorted(record.per_rank) == [0, 1]
        for phases in record.per_rank.values():
            stamps = [phases.phases[p] for p in ("admitted", "started", "finished")]
            assert stamps == sorted(stamps), phases
    assert ok.outcome == "ok" and failed.outcome == "INVALID_ARGUMENT", (ok, failed)
    assert ok.client  # the peer that called
