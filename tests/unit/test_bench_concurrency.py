"""bench/concurrent_clients.py and the shared-cluster bookkeeping, without a cluster (fast)."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import __main__ as entry
from bench import concurrent_clients as cc
from bench import core
from bench.concurrent_clients import (
    ClientRound,
    ConcurrentResult,
    Plan,
    WrongResult,
    chain_expected,
    chain_limit,
    round_rate,
    run_clients,
)


def test_round_rate_is_all_ops_over_the_whole_span() -> None:
    rounds = [ClientRound(10, 1.0, 2.0), ClientRound(30, 1.5, 3.0)]
    assert round_rate(rounds) == pytest.approx(40 / 2.0)
    assert round_rate([ClientRound(5, 0.0, 0.5)]) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        round_rate([])
    with pytest.raises(ValueError):
        round_rate([ClientRound(1, 2.0, 2.0)])


def test_result_aggregates_rounds_and_clients() -> None:
    r0 = [ClientRound(2, 0.0, 1.0, (0.1, 0.3)), ClientRound(1, 0.5, 2.0, (0.2,))]
    r1 = [ClientRound(1, 5.0, 6.0, (0.4,)), ClientRound(3, 5.0, 5.5, (0.5, 0.6, 0.7))]
    result = ConcurrentResult(2, 2, 4, [r0, r1], checks=2, client_cpu_s=0.75)
    assert result.rates == pytest.approx([3 / 2.0, 4 / 1.0])
    assert result.ops == 7
    assert sorted(result.latencies) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    assert result.span_s == pytest.approx(3.0)
    assert result.client_cpu_cores == pytest.approx(0.25)
    assert result.client_p50s == pytest.approx([0.3, 0.6])
    stat = result.ops_per_s()
    assert stat.unit == "/s" and stat.median == pytest.approx(2.75) and stat.worst == 1.5
    assert result.latency().median == pytest.approx(0.4)
    extra = result.as_extra()
    assert extra["ops"] == 7 and extra["chains_checked"] == 2
    assert "2 client(s): 7 ops in 2 round(s)" in result.summary()


def test_chain_limit_keeps_float32_finite() -> None:
    assert chain_limit(2) == 200
    assert chain_limit(4) == 100
    assert chain_limit(3) == 126
    with pytest.raises(ValueError):
        chain_limit(1)
    for world in (2, 3, 4, 8):
        top = (2.0**-100) * world ** (chain_limit(world) + 1)
        assert math.isfinite(top) and top < torch.finfo(torch.float32).max


def test_chain_expected() -> None:
    base = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert torch.equal(chain_expected(base, 3, 1), base)
    assert torch.equal(chain_expected(base, 3, 3), base * 9)
    with pytest.raises(ValueError):
        chain_expected(base, 2, 0)


class FakeCluster:
    """An in-memory cluster: ``all_reduce`` sums every rank's float32 tensor in place;
    ``drop_every`` > 0 makes every n-th all_reduce do nothing (a wrong result)."""

    def __init__(self, world: int, drop_every: int = 0) -> None:
        self.world, self.drop_every = world, drop_every
        self.store: dict[tuple[str, int], torch.Tensor] = {}
        self.calls = 0
        self.lock = threading.Lock()

    def put(self, name: str, t: torch.Tensor, rank: int, timeout: float) -> None:
        with self.lock:
            self.store[(name, rank)] = t.clone()

    def get(self, name: str, rank: int, timeout: float) -> torch.Tensor:
        with self.lock:
            return self.store[(name, rank)].clone()

    def all_reduce(self, name: str, op: str, timeout: float) -> None:
        assert op == "sum"
        with self.lock:
            self.calls += 1
            if self.drop_every and self.calls % self.drop_every == 0:
                return
            total = sum(self.store[(name, r)] for r in range(self.world))
            for r in range(self.world):
                self.store[(name, r)] = total.clone()

    def delete(self, name: str, missing_ok: bool, timeout: float) -> None:
        with self.lock:
            for r in range(self.world):
                self.store.pop((name, r), None)

    def connect(self, address: str, timeout: float) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(self)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_run_clients_checks_every_chain(monkeypatch, world: int) -> None:
    fake = FakeCluster(world)
    monkeypatch.setattr(cc.collectives, "connect", fake.connect)
    plan = Plan(rounds=2, duration_s=5.0, max_ops=300, warmup=3)
    result = run_clients("fake:0", world, 3, plan, nbytes=8)
    assert result.ops == 3 * 2 * 300
    assert fake.calls == result.ops + 3 * 3  # the warmup is not counted
    # chains of chain_limit(world) ops: every full one and each client's last one
    assert result.checks == 3 * math.ceil((300 * 2 + 3) / chain_limit(world))
    assert all(len(r) == 3 for r in result.rounds)
    assert not fake.store  # every client deleted its name


def test_run_clients_raises_on_a_wrong_result(monkeypatch) -> None:
    fake = FakeCluster(2, drop_every=7)
    monkeypatch.setattr(cc.collectives, "connect", fake.connect)
    with pytest.raises(WrongResult, match="all_reduce"):
        run_clients("fake:0", 2, 2, Plan(rounds=1, duration_s=5.0, max_ops=50, warmup=0))


def test_run_clients_stops_at_the_duration(monkeypatch) -> None:
    fake = FakeCluster(2)
    monkeypatch.setattr(cc.collectives, "connect", fake.connect)
    result = run_clients("fake:0", 2, 1, Plan(rounds=1, duration_s=0.0, max_ops=10**9))
    assert result.ops == 1  # at least one op per round, then the deadline has passed


def test_close_shared_cluster_stops_only_that_one(monkeypatch) -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def fake_local_cluster(workers: int, *extra: str):
        events.append(f"start {workers}")
        yield f"addr-{workers}"
        events.append(f"stop {workers}")

    monkeypatch.setattr(core, "local_cluster", fake_local_cluster)
    monkeypatch.setattr(core, "_shared", {})
    assert core.shared_cluster(2) == "addr-2"
    assert core.shared_cluster(3) == "addr-3"
    assert core.shared_cluster(2) == "addr-2"  # shared, not started again
    assert core.close_shared_cluster(3) is True
    assert core.close_shared_cluster(3) is False
    assert events == ["start 2", "start 3", "stop 3"]
    assert core.shared_cluster(3) == "addr-3"  # a fresh one
    core.close_shared_clusters()
    assert sorted(events[3:]) == ["start 3", "stop 2", "stop 3"]
    assert core._shared == {}


def test_discover_orders_the_new_rows() -> None:
    names = entry.discover()
    assert names.index("latency") < names.index("concurrency") < names.index("inference")
    assert names.index("publish") < names.index("scaling")


def test_run_direct_takes_one_repeat_count_per_size(monkeypatch) -> None:
    from bench import direct_gloo

    seen: list[list[str]] = []

    def fake_spawn(module: str, world: int, args: list[str]) -> dict:
        seen.append(args)
        return {"seconds": {"all_reduce:4": [1.0], "all_reduce:8": [2.0]}}

    monkeypatch.setattr(direct_gloo, "spawn_ranks", fake_spawn)
    got = direct_gloo.run_direct(["all_reduce"], 2, [4, 8], [100, 5])
    assert got == {("all_reduce", 4): [1.0], ("all_reduce", 8): [2.0]}
    assert seen[0][seen[0].index("--repeats") + 1] == "100,5"
    direct_gloo.run_direct(["all_reduce"], 2, [4, 8], 7)
    assert seen[1][seen[1].index("--repeats") + 1] == "7"
    with pytest.raises(ValueError):
        direct_gloo.run_direct(["all_reduce"], 2, [4, 8], [1, 2, 3])
