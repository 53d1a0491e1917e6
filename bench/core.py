"""What every benchmark row shares: repeated measurement, rows with anchors, clusters.

A figure is never reported alone: each ``Row`` holds the service's figure and
an *anchor* measured in the same run on the same machine (raw TCP, memcpy,
direct torch.distributed, local torch), and their ratio. Machines are shared
and noisy, so every figure is the median of repeated runs, with min and max.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from . import cpu

__all__ = [
    "Stat",
    "Row",
    "BenchContext",
    "measure",
    "local_cluster",
    "MiB",
    "GiB",
    "shared_cluster",
    "close_shared_cluster",
    "close_shared_clusters",
    "cluster_processes",
]

MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass(frozen=True)
class Stat:
    """A repeated measurement: median, min, max of ``samples`` (in ``unit``).

    ``p99`` is the 99th percentile on the *bad* side: of the times for a time
    unit, the 1st percentile for a rate (``GB/s``, ``/s``); None when unknown.
    """

    median: float
    low: float
    high: float
    unit: str
    samples: int
    p99: float | None = None

    @property
    def higher_is_better(self) -> bool:
        return "/s" in self.unit

    @property
    def worst(self) -> float:
        return self.low if self.higher_is_better else self.high

    def text(self) -> str:
        """``p50 … (p99 …, worst …)`` in a unit scaled to the median (µs, ms or s for times)."""
        scale, unit = _scaled(self.unit, self.median)
        tail = f"p99 {_fmt(self.p99 * scale)}, " if self.p99 is not None else ""
        return f"{_fmt(self.median * scale)} {unit} ({tail}worst {_fmt(self.worst * scale)})"


_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}


def _scaled(unit: str, value: float) -> tuple[float, str]:
    """(factor, unit) that shows ``value`` (in ``unit``) in µs, ms or s when it is a time."""
    seconds = _TIME_UNITS.get(unit)
    if seconds is None or value == 0:
        return 1.0, unit
    v = abs(value) * seconds
    target = "µs" if v < 1e-3 else "ms" if v < 1.0 else "s"
    return seconds / _TIME_UNITS[target], target


class Skip(Exception):
    """Raised by a row module that cannot run on this machine; the reason is printed."""


@dataclass(frozen=True)
class Row:
    """One line of the table: the service beside its anchor.

    The ratio is always service/anchor, in the row's unit. The target says
    which side is good: ">= 0.6" for a throughput (GB/s), "<= 1.5" for a time.
    """

    group: str
    what: str
    service: Stat
    anchor_name: str
    anchor: Stat
    target: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.service.median / self.anchor.median if self.anchor.median else float("nan")

    def met(self) -> bool | None:
        """Whether the target holds (None when there is no target)."""
        if not self.target:
            return None
        op, _, value = self.target.partition(" ")
        bound = float(value)
        return self.ratio >= bound if op == ">=" else self.ratio <= bound

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["met"] = self.met()
        return d


@dataclass
class BenchContext:
    quick: bool
    # Sizes/repeats scale down in quick mode (CI): keep a whole quick run < 2 min.
    repeats: int = 5

    def sizes(self, full: list[int], quick: list[int]) -> list[int]:
        return quick if self.quick else full


def measure(
    fn: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 1,
    unit: str = "s",
    per: Callable[[float], float] | None = None,
) -> Stat:
    """Runs ``fn`` ``warmup + repeats`` times; ``per`` turns seconds into the reported unit
    (e.g. ``lambda s: nbytes / s / 1e9`` for GB/s)."""
    for _ in range(warmup):
        fn()
    values = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - started
        values.append(per(elapsed) if per else elapsed)
    return stat_of(values, unit)


def timed(
    repeats: int,
    warmup: int,
    prepare: Callable[[], object],
    call: Callable[[], object],
    after: Callable[[int], None] | None = None,
) -> list[float]:
    """``prepare(); call()`` warmup + repeats times, timing only ``call``; ``after(i)``
    runs (untimed) after each timed call."""
    seconds = []
    for i in range(warmup + repeats):
        prepare()
        started = time.perf_counter()
        call()
        elapsed = time.perf_counter() - started
        if i >= warmup:
            seconds.append(elapsed)
            if after is not None:
                after(i - warmup)
    return seconds


def throughput(
    call: Callable[[Any], object], clients: list, seconds: float, per_call: int
) -> float:
    """Items/s of ``call(client)`` (``per_call`` items each) run in a loop by one thread per
    client for ``seconds``, the threads started together."""
    counts = [0] * len(clients)
    errors: list[BaseException] = []
    start = threading.Barrier(len(clients) + 1)
    stop_at = [0.0]

    def loop(i: int) -> None:
        try:
            start.wait()
            while time.perf_counter() < stop_at[0]:
                call(clients[i])
                counts[i] += per_call
        except BaseException as exc:  # reported after the window
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(clients))]
    for t in threads:
        t.start()
    stop_at[0] = time.perf_counter() + seconds
    began = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def stat_of(values: list[float], unit: str) -> Stat:
    """Median, min, max and the bad-side 99th percentile of ``values``."""
    ordered = sorted(values)
    bad = 1 if "/s" in unit else 99
    index = min(len(ordered) - 1, max(0, round(bad / 100 * (len(ordered) - 1))))
    return Stat(
        statistics.median(values), ordered[0], ordered[-1], unit, len(values), ordered[index]
    )


@contextlib.contextmanager
def local_cluster(workers: int, *extra: str) -> Iterator[str]:
    """``collectives-server local`` for the duration of a block; yields the coordinator address."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "collectives_server",
            "local",
            "--workers",
            str(workers),
            "--log-level",
            "WARNING",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    address = ""
    try:
        address = proc.stdout.readline().strip() if proc.stdout else ""
        if not address:
            raise RuntimeError("collectives-server local did not start")
        _launchers[address] = proc.pid
        yield address
    finally:
        _launchers.pop(address, None)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_shared: dict[tuple[str, ...], tuple[str, contextlib.ExitStack]] = {}
# address: pid of the ``collectives-server local`` process serving it
_launchers: dict[str, int] = {}


def cluster_processes(address: str) -> dict[int, str]:
    """pid: label of every process of the :func:`local_cluster` at ``address``: the
    launcher, each worker ("rank r", from the SDK's worker list) and the coordinator
    (the launcher's one other child); empty when unknown or without ``/proc``."""
    import collectives

    root = _launchers.get(address)
    if root is None or not cpu.available():
        return {}
    with collectives.connect(address, timeout=60.0) as cluster:
        ranks = {w.pid: f"rank {w.rank}" for w in cluster.workers()}
    pids = cpu.tree(root)
    others = [pid for pid in pids if pid != root and pid not in ranks]
    labels = {root: "launcher", **ranks}
    for pid in others:
        labels[pid] = "coordinator" if len(others) == 1 else f"pid {pid}"
    return {pid: labels[pid] for pid in pids}


def _shared_key(workers: int, extra: tuple[str, ...]) -> tuple[str, ...]:
    # Every shared cluster may build the server's model-zoo factories (rows 5 and 10 do).
    return (str(workers), "--allow-factory", "collectives_server.model_zoo", *extra)


def shared_cluster(workers: int, *extra: str) -> str:
    """The address of a ``local_cluster(workers, *extra)`` shared by every row that asks for
    the same arguments (starting a cluster costs ~10-20 s on 2 cores); it lives until
    :func:`close_shared_cluster` or :func:`close_shared_clusters` (called by ``python -m
    bench`` after the rows, after a failed row, and at exit). Rows must delete what they
    store on it."""
    key = _shared_key(workers, extra)
    if key not in _shared:
        stack = contextlib.ExitStack()
        address = stack.enter_context(local_cluster(workers, *key[1:]))
        _shared[key] = (address, stack)
    return _shared[key][0]


def close_shared_cluster(workers: int, *extra: str) -> bool:
    """Stops the shared cluster ``shared_cluster(workers, *extra)`` started, if it runs
    (a later ``shared_cluster`` call starts a fresh one); returns whether one ran."""
    entry = _shared.pop(_shared_key(workers, extra), None)
    if entry is not None:
        entry[1].close()
    return entry is not None


def close_shared_clusters() -> None:
    """Stops every shared cluster (each one even when stopping another raised)."""
    with contextlib.ExitStack() as all_of_them:
        for _, stack in _shared.values():
            all_of_them.push(stack)
        _shared.clear()


atexit.register(close_shared_clusters)


def machine() -> dict:
    import grpc
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "loadavg_1m": round(load[0], 2),
        "cuda": torch.cuda.is_available(),
    }


def _fmt(x: float) -> str:
    if x == 0 or 0.01 <= abs(x) < 10000:
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    if abs(x) >= 10000:
        return f"{x:,.0f}"  # 19,700 rather than 1.97e+04
    return f"{x:.3g}"
