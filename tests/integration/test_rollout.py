"""A rolling restart under load: every member of a 3-member cluster with one spare
replaced in turn while four clients keep calling, and not one call fails or is wrong.

The clients, each on its own connection: two run ``dp(x)`` of a loaded model with
batching on (their forwards merge), one all-reduces tensors resident on every rank
into a new name, one puts and gets. Every answer is compared with what torch
computes locally. The members are replaced by ``collectives rollout`` (a drain each,
onto the spare that the previous drained worker became), by SIGTERM to each member
in turn (it drains itself), and in Kubernetes' order (the preStop hook's drain,
then SIGTERM). Afterwards every resident tensor and the model's version are what
they were. The test prints each handoff's time (the preparation, while the
member still served, and the switch) and the calls' p99 during the change
against steady state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch
from helpers import assert_tensor, connect_ready, wait_until

import collectives
from collectives_server import model_zoo

ZOO = "collectives_server.model_zoo"
KWARGS = {"in_features": 16, "hidden": 64, "out_features": 8, "depth": 2, "seed": 11}
WORLD = 3
FLAGS = (
    "--spares", "1", "--heartbeat", "0.2", "--lease", "3", "--devices", "cpu",
    "--allow-factory", ZOO, "--factory-batching", "32:2",
)  # fmt: skip
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _spares(cluster: collectives.Cluster) -> list[collectives.WorkerInfo]:
    return [w for w in cluster.workers() if w.state == "spare"]


def _p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


class Load:
    """Four clients calling until stopped; every failure and wrong answer kept."""

    def __init__(self, address: str, model: str, resident: list[torch.Tensor]) -> None:
        self._address = address
        self._model = model
        self._resident_sum = torch.stack(resident).sum(0)
        self._local = model_zoo.mlp(**KWARGS).eval()
        # The oracle's first call imports torch.testing's comparison code, holding the GIL
        # of this process (every client's) for a moment: not the service's time.
        assert_tensor(self._resident_sum, self._resident_sum.clone(), exact=False)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.failures: list[str] = []
        self.calls: list[tuple[float, float, int]] = []  # (start, latency, client)
        self._threads = [
            threading.Thread(target=self._run, args=(body, i), daemon=True)
            for i, body in enumerate((self._infer, self._infer, self._reduce, self._put_get))
        ]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self._threads), "a client did not stop"

    def latencies(self, since: float, until: float) -> list[float]:
        with self._lock:
            return [lat for start, lat, _ in self.calls if since <= start < until]

    def by_kind(self, since: float, until: float) -> dict[str, list[float]]:
        """The latencies in the window by kind of call."""
        kinds = ("dp(x)", "dp(x)", "all_reduce", "put/get")
        out: dict[str, list[float]] = {}
        with self._lock:
            for start, lat, i in self.calls:
                if since <= start < until:
                    out.setdefault(kinds[i], []).append(lat)
        return out

    def slowest(self, since: float, until: float) -> tuple[float, str]:
        """The slowest call in the window, and which client's it was."""
        kinds = ("dp(x)", "dp(x)", "all_reduce", "put/get")
        with self._lock:
            window = [(lat, i) for start, lat, i in self.calls if since <= start < until]
        if not window:
            return 0.0, "-"
        lat, i = max(window)
        return lat, kinds[i]

    def _run(self, body: Callable[[collectives.Cluster, torch.Generator, int], None], i: int):
        gen = torch.Generator().manual_seed(1000 + i)
        with connect_ready(self._address, WORLD) as client:
            n = 0
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    body(client, gen, n)
                except Exception as exc:  # every failure is the test's finding
                    seen = client.snapshot()
                    view = (
                        f"[view: generation {seen.generation}, members "
                        + ", ".join(f"{w.rank}={w.address}" for w in seen.members)
                        + f", drain {seen.drain is not None}]"
                    )
                    with self._lock:
                        self.failures.append(
                            f"client {i} call {n} at {time.monotonic():.3f}: "
                            f"{type(exc).__name__}: {exc} {view}"
                        )
                else:
                    with self._lock:
                        self.calls.append((started, time.monotonic() - started, i))
                n += 1

    def _infer(self, client: collectives.Cluster, gen: torch.Generator, n: int) -> None:
        dp = client.data_parallel(self._model)
        x = torch.randn(1 + n % 4, KWARGS["in_features"], generator=gen)
        with torch.no_grad():
            got = dp(x)
            want = self._local(x)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            worst = (got - want).abs().max()
            raise AssertionError(f"dp(x) differs from the local model by {worst}")

    def _reduce(self, client: collectives.Cluster, gen: torch.Generator, n: int) -> None:
        out = f"roll/sum/{n % 4}"
        client.all_reduce("roll/resident", out=out, timeout=60)
        rank = n % WORLD
        assert_tensor(
            client.get(out, rank=rank, timeout=60),
            self._resident_sum,
            exact=False,
            what=f"all_reduce of the resident tensors on rank {rank}",
        )

    def _put_get(self, client: collectives.Cluster, gen: torch.Generator, n: int) -> None:
        t = torch.randn(int(torch.randint(1, 200_000, (1,), generator=gen)), generator=gen)
        rank = n % WORLD
        client.put("roll/pg", t, rank=rank, timeout=60)
        assert_tensor(client.get("roll/pg", rank=rank, timeout=60), t, what=f"put/get on {rank}")


def _prepared(fresh_cluster, gen):
    local, cluster = fresh_cluster(WORLD, *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    name = "roll/mlp"
    info = cluster.load_model(
        name, factory=f"{ZOO}:mlp", kwargs=KWARGS, batching=collectives.Batching(32, 2.0)
    )
    cluster.data_parallel(name).eval()  # recorded: every call that names no mode runs eval
    resident = [torch.randn(4099, generator=gen) for _ in range(WORLD)]
    for rank, t in enumerate(resident):
        cluster.put("roll/resident", t, rank=rank)
    keepsakes = {rank: torch.randn(6 * 1024 * 1024 // 4, generator=gen) for rank in range(WORLD)}
    for rank, t in keepsakes.items():
        cluster.put("roll/keepsake", t, rank=rank)  # 6 MiB per rank: over the bulk port
    return local, cluster, name, info.version, resident, keepsakes


def _check_after(cluster, name, version, resident, keepsakes, originals: set[str]) -> None:
    members = [w.worker_id for w in cluster.workers() if w.rank >= 0]
    assert not originals & set(members), f"members {members} still include an original"
    for rank in range(WORLD):
        assert_tensor(cluster.get("roll/resident", rank=rank), resident[rank], what=f"rank {rank}")
        assert_tensor(cluster.get("roll/keepsake", rank=rank), keepsakes[rank], what=f"rank {rank}")
    (model,) = [m for m in cluster.models() if m.name == name]
    # The version, its recorded mode and its batching, on every member (from its peers).
    assert model.version == version and model.batching == collectives.Batching(32, 2.0)
    assert model.training is False


def _report(what: str, load: Load, steady: tuple[float, float], change: tuple[float, float],
            reports: list[collectives.DrainReport]) -> None:  # fmt: skip
    before, during = load.latencies(*steady), load.latencies(*change)
    print(
        f"\n{what}: {len(load.calls)} calls, 0 failed; handoffs (prepared ahead, then the "
        "switch) "
        + ", ".join(
            f"{r.seconds * 1000:.0f} ms ({r.prepare_seconds * 1000:.0f} + "
            f"{(r.seconds - r.prepare_seconds) * 1000:.0f})"
            for r in reports
        )
        + f"; p99 steady {_p99(before) * 1000:.1f} ms ({len(before)} calls), during "
        f"{_p99(during) * 1000:.1f} ms ({len(during)} calls), ratio "
        f"{_p99(during) / max(_p99(before), 1e-9):.2f}; the slowest during: "
        "{:.0f} ms ({})".format(load.slowest(*change)[0] * 1000, load.slowest(*change)[1])
    )
    steady_kinds, change_kinds = load.by_kind(*steady), load.by_kind(*change)
    print(
        "  p99 by call, steady -> during: "
        + "; ".join(
            f"{kind} {_p99(steady_kinds.get(kind, [0.0])) * 1000:.1f} -> {_p99(lats) * 1000:.1f} ms"
            for kind, lats in sorted(change_kinds.items())
        )
    )


def _steady(load: Load, calls: int = 200, timeout: float = 60) -> tuple[float, float]:
    """The window of the next ``calls`` calls (after the clients' first calls, which
    connect and fetch what they need): enough that the steady p99 is not just the
    slowest call of a handful."""
    warm = time.monotonic()
    wait_until(lambda: len(load.latencies(warm, float("inf"))) >= 20, timeout, "warm calls")
    start = time.monotonic()
    wait_until(lambda: len(load.latencies(start, float("inf"))) >= calls, timeout, "steady calls")
    return start, time.monotonic()


def test_collectives_rollout_replaces_every_member_under_load(fresh_cluster, gen) -> None:
    local, cluster, name, version, resident, keepsakes = _prepared(fresh_cluster, gen)
    originals = {w.worker_id for w in cluster.workers() if w.rank >= 0}
    load = Load(local.address, name, resident).start()
    try:
        steady = _steady(load)
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "collectives.cli.main", "rollout", "--coordinator",
             local.address, "--timeout", "60"],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        change = (began, time.monotonic())
        assert done.returncode == 0, done.stderr
        lines = [line for line in done.stdout.splitlines() if line.startswith("drained ")]
        assert len(lines) == WORLD, done.stdout
        _steady(load, calls=20)  # and the clients carry on on the new members
    finally:
        load.stop()
    assert load.failures == [], "\n".join(load.failures)
    _check_after(cluster, name, version, resident, keepsakes, originals)
    reports = [r for r in cluster.snapshot().drains if not r.error][-WORLD:]
    assert {r.worker_id for r in reports} == originals
    assert all(r.models_moved == 1 and r.tensors_moved >= 2 for r in reports), reports
    _report("rollout", load, steady, change, reports)


@pytest.mark.parametrize("order", ["sigterm", "kubernetes"])
def test_stopping_each_member_drains_it_first(fresh_cluster, gen, order: str) -> None:
    """SIGTERM to each member in turn (as a supervisor stops it); in Kubernetes' order the
    preStop hook (``collectives drain`` of itself) runs first, then SIGTERM follows."""
    local, cluster, name, version, resident, keepsakes = _prepared(fresh_cluster, gen)
    originals = [w for w in cluster.workers() if w.rank >= 0]
    load = Load(local.address, name, resident).start()
    try:
        steady = _steady(load)
        began = time.monotonic()
        for member in originals:
            wait_until(lambda: len(_spares(cluster)) == 1 and cluster.ready, 60, "a spare")
            drains = len(cluster.snapshot().drains)
            if order == "kubernetes":
                hook = subprocess.run(
                    [sys.executable, "-m", "collectives.cli.main", "drain", "--coordinator",
                     local.address, member.address, "--timeout", "60"],
                    capture_output=True, text=True, timeout=120,
                )  # fmt: skip
                assert hook.returncode == 0, hook.stderr
            # After the preStop drain the worker exits by itself (drained): the SIGTERM
            # that follows finds it gone, as the kubelet's would.
            with contextlib.suppress(ProcessLookupError):
                os.kill(member.pid, signal.SIGTERM)

            def drained(before: int = drains, gone: str = member.worker_id) -> bool:
                members = {w.worker_id for w in cluster.refresh().members}
                return len(cluster.snapshot().drains) > before and gone not in members

            wait_until(drained, 90, f"{member.worker_id} to be drained")
            assert not cluster.snapshot().drains[-1].error, cluster.snapshot().drains[-1]
        change = (began, time.monotonic())
        _steady(load, calls=20)
    finally:
        load.stop()
    assert load.failures == [], "\n".join(load.failures)
    _check_after(cluster, name, version, resident, keepsakes, {w.worker_id for w in originals})
    reports = cluster.snapshot().drains[-WORLD:]
    _report(order, load, steady, change, list(reports))
