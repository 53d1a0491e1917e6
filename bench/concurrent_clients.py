"""Concurrent SDK clients, each issuing a checked all_reduce in a loop (rows 4b and 11).

``run_clients(address, world, clients, plan)`` starts ``clients`` threads in this
process, each with its own ``collectives.connect`` (its own channels and
membership stream) and its own tensor name, and runs ``plan.rounds`` timed
rounds: a barrier starts every client together, each issues
``cluster.all_reduce(name, op="sum")`` back to back until the round's duration
or op count is used up, and a second barrier ends the round. A round's figure
is the aggregate rate, every client's ops over the span from the first client's
start to the last one's finish; the latencies are those of the single
all_reduce calls. Every loop is bounded by ``plan.max_ops`` and
``plan.duration_s``; every wait by a timeout.

Threads rather than processes: the client spends well under a core per process
(gRPC's blocking calls release the GIL), which ``client_cpu_cores`` reports for
every run (a GIL-bound client would sit near 1.0); processes would cost several
seconds each to start (importing torch) and would compete for the same cores.

Every result is checked. ``all_reduce`` returns None (the result stays on the
workers), so each client runs *chains*: it puts different random float32 values
on every rank, then every in-place sum multiplies the (from then on equal) value
by ``world``; after k ops every rank must hold ``sum(values) * world**(k-1)``.
One ``get`` per rank at the end of a chain checks every op of the chain: a
skipped, repeated or partial reduction changes the value by a factor of at
least (world-1)/world. Values start near 2**-100, so a chain of
``chain_limit(world)`` ops stays inside float32's range; a full chain is checked
and replaced by fresh values (untimed, but inside the round's span: ~1-2% of
its calls at world 2), and the last chain after the last round. A wrong value
raises :class:`WrongResult`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import collectives

from .anchors import percentile
from .core import Stat, stat_of
from .cpu import CpuMeter

__all__ = [
    "Plan",
    "ClientRound",
    "ConcurrentResult",
    "WrongResult",
    "chain_limit",
    "chain_expected",
    "round_rate",
    "timed_round",
    "run_clients",
]

# Chains start at values in [2**-101, 2**-100) and may grow by 2**200 (float32 max ~2**128).
_START_SCALE = 2.0**-100
_GROWTH_BITS = 200
_RTOL = 1e-4  # float32 rounding of up to ~130 chained sums (world 3) is < 2e-5
_OP_TIMEOUT_S = 120.0
_BARRIER_TIMEOUT_S = 300.0  # connecting 32 clients and their warmup on 2 loaded cores


class WrongResult(AssertionError):
    """A checked all_reduce chain did not hold the expected sum on some rank."""


@dataclass(frozen=True)
class Plan:
    """How each client loops: ``rounds`` timed rounds of at most ``duration_s`` seconds and
    ``max_ops`` ops each (at least one op), after ``warmup`` untimed, checked ops."""

    rounds: int
    duration_s: float
    max_ops: int
    warmup: int = 5


@dataclass(frozen=True)
class ClientRound:
    """One client's share of one round: ops done between ``started`` and ``finished``
    (``time.perf_counter`` seconds) and each op's latency."""

    ops: int
    started: float
    finished: float
    latencies: tuple[float, ...] = ()


def chain_limit(world: int) -> int:
    """How many in-place sums a chain may run before its values could leave float32's range."""
    if world < 2:
        raise ValueError(f"world must be >= 2, not {world}")
    return int(_GROWTH_BITS // math.log2(world))


def chain_expected(base_sum: torch.Tensor, world: int, ops: int) -> torch.Tensor:
    """What every rank holds after ``ops`` >= 1 in-place sums of per-rank values summing to
    ``base_sum`` (float64)."""
    if ops < 1:
        raise ValueError("a chain is checked after at least one op")
    return base_sum.double() * float(world) ** (ops - 1)


def timed_round(
    plan: Plan, op: Callable[[], object], between: Callable[[], object] | None = None
) -> ClientRound:
    """Calls ``op`` back to back, timing each call, until ``plan.max_ops`` calls (at least
    one) or ``plan.duration_s`` is used up; ``between`` runs untimed before each call."""
    started = time.perf_counter()
    deadline = started + plan.duration_s
    latencies: list[float] = []
    while len(latencies) < max(1, plan.max_ops) and (
        not latencies or time.perf_counter() < deadline
    ):
        if between is not None:
            between()
        began = time.perf_counter()
        op()
        latencies.append(time.perf_counter() - began)
    return ClientRound(len(latencies), started, time.perf_counter(), tuple(latencies))


def round_rate(rounds: Sequence[ClientRound]) -> float:
    """Aggregate ops/s of one round: every client's ops over the span from the first start
    to the last finish."""
    if not rounds:
        raise ValueError("no clients")
    ops = sum(r.ops for r in rounds)
    span = max(r.finished for r in rounds) - min(r.started for r in rounds)
    if span <= 0:
        raise ValueError(f"round span {span} s is not positive")
    return ops / span


@dataclass
class ConcurrentResult:
    """``clients`` clients' rounds (``rounds[r][c]``: client c in round r) and their checks."""

    clients: int
    world: int
    nbytes: int
    rounds: list[list[ClientRound]]
    checks: int
    client_cpu_s: float
    extra: dict = field(default_factory=dict)
    # CPU seconds each cluster process spent in the rounds, by its label ("rank 0",
    # "coordinator", ...: the labels of run_clients' ``server_pids``).
    server_cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def rates(self) -> list[float]:
        return [round_rate(r) for r in self.rounds]

    @property
    def latencies(self) -> list[float]:
        return [lat for rnd in self.rounds for c in rnd for lat in c.latencies]

    @property
    def client_p50s(self) -> list[float]:
        """Each client's p50 latency (seconds) over its ops in every round."""
        per_client = zip(*self.rounds, strict=True)
        return [percentile([x for r in rounds for x in r.latencies], 50) for rounds in per_client]

    @property
    def ops(self) -> int:
        return sum(c.ops for rnd in self.rounds for c in rnd)

    @property
    def span_s(self) -> float:
        return sum(max(c.finished for c in r) - min(c.started for c in r) for r in self.rounds)

    @property
    def client_cpu_cores(self) -> float:
        """The client process's CPU seconds per second of the rounds (~1.0: GIL-bound)."""
        return self.client_cpu_s / self.span_s if self.span_s > 0 else float("nan")

    @property
    def cpu_per_op_s(self) -> float:
        """CPU seconds per op of this process (the clients) and every cluster process."""
        cpu = self.client_cpu_s + sum(self.server_cpu_s.values())
        return cpu / self.ops if self.ops else float("nan")

    def cpu_ceiling(self, cores: int) -> float:
        """The most ops/s ``cores`` could run at this CPU per op, whatever overlaps."""
        return cores / self.cpu_per_op_s

    def cpu_breakdown(self) -> str:
        """``client 0.41 ms, rank 0 0.93 ms, ...``: CPU per op of each process."""
        if not self.ops:
            return "no ops"
        parts = [("client", self.client_cpu_s), *self.server_cpu_s.items()]
        return ", ".join(f"{label} {s / self.ops * 1e3:.2f} ms" for label, s in parts)

    def ops_per_s(self) -> Stat:
        """Aggregate ops/s, one figure per round."""
        return stat_of(self.rates, "/s")

    def latency(self) -> Stat:
        """Seconds per all_reduce call, every client's ops pooled."""
        return stat_of(self.latencies, "s")

    def summary(self) -> str:
        lat = self.latencies
        return (
            f"{self.clients} client(s): {self.ops} ops in {len(self.rounds)} round(s), "
            f"{sum(self.rates) / len(self.rounds):.0f} ops/s, "
            f"p50 {percentile(lat, 50) * 1e3:.3g} ms, p99 {percentile(lat, 99) * 1e3:.3g} ms, "
            f"{self.checks} chain(s) checked, client CPU {self.client_cpu_cores:.2f} cores"
        )

    def as_extra(self) -> dict:
        lat = self.latencies
        return {
            "clients": self.clients,
            "world": self.world,
            "bytes": self.nbytes,
            "ops": self.ops,
            "rates_per_s": self.rates,
            "p50_ms": percentile(lat, 50) * 1e3,
            "p99_ms": percentile(lat, 99) * 1e3,
            "client_p50s_ms": [x * 1e3 for x in self.client_p50s],
            "chains_checked": self.checks,
            "client_cpu_cores": self.client_cpu_cores,
            "cpu_per_op_ms": self.cpu_per_op_s * 1e3,
            "server_cpu_s": self.server_cpu_s,
        }


class _Chain:
    """One client's checked chain of in-place sums on ``name``."""

    def __init__(self, cluster, name: str, world: int, numel: int, seed: int) -> None:
        self.cluster, self.name, self.world, self.numel = cluster, name, world, numel
        self.limit = chain_limit(world)
        self.generator = torch.Generator().manual_seed(seed)
        self.ops = 0
        self.checks = 0
        self.base_sum = torch.zeros(numel, dtype=torch.float64)

    def start(self) -> None:
        """Puts fresh random values (a different tensor on every rank)."""
        total = torch.zeros(self.numel, dtype=torch.float64)
        for rank in range(self.world):
            t = (torch.rand(self.numel, generator=self.generator) * 0.5 + 0.5) * _START_SCALE
            self.cluster.put(self.name, t, rank=rank, timeout=_OP_TIMEOUT_S)
            total += t.double()
        self.base_sum, self.ops = total, 0

    def op(self) -> None:
        self.cluster.all_reduce(self.name, op="sum", timeout=_OP_TIMEOUT_S)
        self.ops += 1

    @property
    def full(self) -> bool:
        return self.ops >= self.limit

    def check(self) -> None:
        """Raises WrongResult unless every rank holds the chain's expected value."""
        if self.ops == 0:
            return
        expected = chain_expected(self.base_sum, self.world, self.ops)
        for rank in range(self.world):
            got = self.cluster.get(self.name, rank=rank, timeout=_OP_TIMEOUT_S)
            if got.dtype != torch.float32 or got.shape != (self.numel,):
                raise WrongResult(f"{self.name} rank {rank}: got {got.dtype} {tuple(got.shape)}")
            if not torch.allclose(got.double(), expected, rtol=_RTOL, atol=0.0):
                bad = int((~torch.isclose(got.double(), expected, rtol=_RTOL, atol=0.0)).sum())
                raise WrongResult(
                    f"{self.name} rank {rank} after {self.ops} all_reduce(sum) ops: {bad} of "
                    f"{self.numel} values differ from the torch sum (first: got "
                    f"{got.flatten()[0].item():.6g}, expected {expected.flatten()[0].item():.6g})"
                )
        self.checks += 1

    def restart(self) -> None:
        self.check()
        self.start()

    def restart_if_full(self) -> None:
        """Checks a full chain and starts a fresh one (before an op that would overflow)."""
        if self.full:
            self.restart()


@dataclass
class _Shared:
    start: threading.Barrier
    done: threading.Barrier
    errors: list[BaseException] = field(default_factory=list)

    def fail(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.start.abort()
        self.done.abort()


def _client(
    address: str,
    world: int,
    name: str,
    numel: int,
    plan: Plan,
    seed: int,
    shared: _Shared,
    out: list[ClientRound],
    checks: list[int],
) -> None:
    try:
        with collectives.connect(address, timeout=_OP_TIMEOUT_S) as cluster:
            chain = _Chain(cluster, name, world, numel, seed)
            try:
                chain.start()
                for _ in range(plan.warmup):
                    chain.restart_if_full()
                    chain.op()
                for _ in range(plan.rounds):
                    chain.restart_if_full()
                    shared.start.wait()
                    out.append(timed_round(plan, chain.op, between=chain.restart_if_full))
                    shared.done.wait()
                chain.check()
                checks.append(chain.checks)
            finally:
                cluster.delete(name, missing_ok=True, timeout=_OP_TIMEOUT_S)
    except threading.BrokenBarrierError:
        pass  # another client failed; its error is reported
    except BaseException as exc:
        shared.fail(exc)


def run_clients(
    address: str,
    world: int,
    clients: int,
    plan: Plan,
    *,
    nbytes: int = 4,
    prefix: str = "bench/concurrent",
    server_pids: dict[int, str] | None = None,
) -> ConcurrentResult:
    """Runs ``clients`` concurrent checked all_reduce loops on ``nbytes`` float32 tensors
    (names ``prefix/0`` ...) against the cluster at ``address``; raises the first client's
    error (e.g. :class:`WrongResult`). ``server_pids`` (pid: label): the cluster's
    processes, whose CPU time over the rounds the result reports."""
    numel = max(1, nbytes // 4)
    shared = _Shared(
        threading.Barrier(clients + 1, timeout=_BARRIER_TIMEOUT_S),
        threading.Barrier(clients + 1, timeout=_BARRIER_TIMEOUT_S),
    )
    outs: list[list[ClientRound]] = [[] for _ in range(clients)]
    checks: list[int] = []
    threads = [
        threading.Thread(
            target=_client,
            args=(address, world, f"{prefix}/{i}", numel, plan, i, shared, outs[i], checks),
            name=f"bench-client-{i}",
            daemon=True,
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    cpu = 0.0
    labels = server_pids or {}
    servers = CpuMeter(labels)
    try:
        for _ in range(plan.rounds):
            shared.start.wait()
            cpu_started = time.process_time()
            servers.start()
            shared.done.wait()
            servers.stop()
            cpu += time.process_time() - cpu_started
    except threading.BrokenBarrierError:
        pass
    join_deadline = time.monotonic() + _BARRIER_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, join_deadline - time.monotonic()))
    if shared.errors:
        raise shared.errors[0]
    if any(t.is_alive() for t in threads) or len(checks) != clients:
        raise RuntimeError(f"{clients} clients: {len(checks)} finished within the time limit")
    rounds = [[outs[c][r] for c in range(clients)] for r in range(plan.rounds)]
    return ConcurrentResult(
        clients,
        world,
        numel * 4,
        rounds,
        sum(checks),
        cpu,
        server_cpu_s={labels[pid]: s for pid, s in servers.spent.items()},
    )
