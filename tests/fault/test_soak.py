"""Soak: 8 clients run mixed collectives while a worker is killed and replaced, repeatedly.

Duration: ``COLLECTIVES_SOAK_S`` seconds (default 20, as ``make test`` runs it;
``make fault`` runs 40, and a real soak a few minutes). Prints ops, correct
results, clean failures, wrong results and hangs; the last two must be 0. A
result is judged only when the membership did not change during its iteration
(otherwise the set of contributing ranks is not what the client put to, and a
refusal is the correct outcome).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time

import pytest
import torch
from harness import OP_TIMEOUT_S, SOAK_LINES, wait_until

import collectives

SOAK_S = float(os.environ.get("COLLECTIVES_SOAK_S", "20"))
CLIENTS = 8
KILL_EVERY_S = 8.0
HANG_GRACE_S = 10.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SOAK_S) + 240)]


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.failures: collections.Counter = collections.Counter()
        self.wrong: list[str] = []

    def add(self, key: str, detail: str = "") -> None:
        with self.lock:
            self.counts[key] += 1
            if key == "clean failure":
                self.failures[detail] += 1
            if key == "wrong":
                self.wrong.append(detail)


def _iteration(client: collectives.Cluster, me: int, i: int, rng: random.Random, tally: Tally):
    name = f"soak/{me}/{i % 4}"
    g0 = client.generation
    members = sorted((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
    kind = rng.choice(["all_reduce", "broadcast", "all_gather", "reduce"])
    parts = [torch.randn(rng.randint(1, 2048)) for _ in members]
    size = parts[0].numel()
    parts = [torch.randn(size) for _ in members]
    started = time.monotonic()
    try:
        if kind == "broadcast":
            client.put(name, parts[0], rank=0)
            client.broadcast(name, src=0, timeout=OP_TIMEOUT_S * 2)
            got = [client.get(name, rank=w.rank) for w in members]
            want = [parts[0]] * len(members)
        else:
            for w, t in zip(members, parts, strict=True):
                client.put(name, t, rank=w.rank)
            if kind == "all_reduce":
                client.all_reduce(name, out=name + "/r", timeout=OP_TIMEOUT_S * 2)
                got = [client.get(name + "/r", rank=w.rank) for w in members]
                want = [sum(parts)] * len(members)
            elif kind == "reduce":
                got = [client.reduce(name, dst=0, op="max", timeout=OP_TIMEOUT_S * 2)]
                want = [torch.stack(parts).amax(0)]
            else:
                got = client.all_gather(name, out=name + "/g", timeout=OP_TIMEOUT_S * 2)
                want = parts
        outcome = "ok"
        if client.generation != g0 or len(got) != len(want):
            outcome = "churned"
        else:
            for a, b in zip(got, want, strict=True):
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
                    outcome = "wrong"
        tally.add(outcome, f"{kind} gen {g0}")
    except collectives.CollectiveError as err:
        tally.add("clean failure", err.code.name)
    elapsed = time.monotonic() - started
    if elapsed > OP_TIMEOUT_S * 2 * 4 + HANG_GRACE_S:  # 4 calls per iteration at most
        tally.add("slow", f"{kind} took {elapsed:.1f} s")


def test_soak_mixed_ops_while_workers_die_and_return(fault_cluster) -> None:
    cluster = fault_cluster(3, 2)
    tally = Tally()
    stop_at = time.monotonic() + SOAK_S
    kills = 0

    def client_loop(me: int) -> None:
        rng = random.Random(1000 + me)
        with collectives.connect(cluster.coordinator.address, timeout=60) as client:
            i = 0
            while time.monotonic() < stop_at:
                _iteration(client, me, i, rng, tally)
                i += 1

    threads = [
        threading.Thread(target=client_loop, args=(me,), daemon=True) for me in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    rng = random.Random(7)
    schedule = threading.Event()  # never set: waiting on it is waiting for the next kill time
    next_kill = time.monotonic() + KILL_EVERY_S / 2
    while next_kill < stop_at - KILL_EVERY_S / 2:
        schedule.wait(max(0.0, next_kill - time.monotonic()))
        alive = [d for d in cluster.workers if d.proc.poll() is None]
        victim = rng.choice(alive)
        victim.signal(signal.SIGKILL)
        victim.proc.wait(10)
        cluster.workers.remove(victim)
        cluster.workers.append(cluster.start_worker())
        kills += 1
        next_kill = time.monotonic() + KILL_EVERY_S
    for t in threads:
        t.join(timeout=OP_TIMEOUT_S * 8 + HANG_GRACE_S + max(0.0, stop_at - time.monotonic()))
    hangs = sum(t.is_alive() for t in threads)
    counts = tally.counts
    ops = sum(counts[k] for k in ("ok", "churned", "wrong", "clean failure"))
    summary = [
        f"{SOAK_S:.0f} s, {CLIENTS} clients, {kills} workers killed and replaced",
        f"ops {ops} | correct {counts['ok']} | clean failures {counts['clean failure']} "
        f"{dict(tally.failures)} | unjudged (membership changed mid-op) {counts['churned']} "
        f"| wrong {counts['wrong']} | hangs {hangs}",
    ]
    SOAK_LINES.extend(summary)  # printed by the fault suite's conftest at the end of the run
    assert kills >= 1
    assert counts["wrong"] == 0, tally.wrong[:5]
    assert hangs == 0
    assert counts["ok"] > 0
    # The cluster is whole again at the end.
    cluster.wait_ready(3, timeout_s=30)
    wait_until(lambda: cluster.client.world_size == 3, 10, "world size 3")
