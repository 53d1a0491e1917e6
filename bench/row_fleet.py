"""Serving like a fleet: small requests from many callers, routed and batched.

Online inference sends small requests from many callers at once. Here 8
callers (threads, each with its own ``collectives.connect``) send 1-row and
4-row ``dp(x)`` requests, under ``torch.no_grad()``, to a local cluster of 2
workers, for two MLPs of the model zoo in eval mode:

- memory-bound (full: 2048-4096-2048, 64 MiB of weights; quick:
  1024-2048-1024), where a forward of a few rows costs little more than one of
  one row, the case batching exists for;
- call-bound (256-1024-256), where a call's own work dominates.

Each model is loaded four times, to measure in the same run:

- **rank 0, batching off**: the path every small request took before routing
  (and still takes while a model's replicas may differ: here a ``step`` with
  ``lr=0`` after the load says so, and ``dp(x)`` runs its one part where a
  split runs it, on rank 0);
- **routed, batching off**: the parts placed by load (``collectives.models.placement``);
- **routed, batching on**: the same with ``Batching(max_rows=64, max_delay_ms=2)``;
- **rank 0, batching on**.

Anchors: the rank-0 path without batching, and the minimal gRPC fan-out floor
(:mod:`bench.direct_fanout`: raw bytes over one unary method, one call per part)
with its callers' small requests spread round-robin over its servers.

For 1-row requests of the memory-bound model, one more row measures the bound
of batching here: the model's own forward of 8 rows (the largest batch 8
one-row callers can merge into) in this process, with every core and no
service around it.

Rows give rows/s of the 8 callers together (median of the windows) and, in
the note, the p50 and p99 of one call's latency under that load.

Callers and workers share this machine's cores, as in every row. Where they are
few (2 on the CI machine), spreading calls over the workers cannot add compute:
the workers already share every core with each other and with the callers
(pinning each worker to its own core was tried: the callers' threads then
delay the pinned workers' wake-ups). Routing pays where each worker has cores (or a GPU)
of its own; ``docs/perf-log.md`` has the figures of both.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch

import collectives
from collectives_server.model_zoo import mlp

from .core import BenchContext, Row, local_cluster, stat_of
from .direct_fanout import FloorFanout

NAME = "fleet"
GROUP = "5c fleet"
WORKERS = 2
CALLERS = 8
FACTORY = "collectives_server.model_zoo:mlp"
BATCHING = collectives.Batching(max_rows=64, max_delay_ms=2)
# (label, path): the four ways each model is served, in measuring order.
PATHS = (
    ("rank 0, batching off", "rank0-plain"),
    ("routed, batching off", "routed-plain"),
    ("routed, batching on", "routed-batched"),
    ("rank 0, batching on", "rank0-batched"),
)


def _models(ctx: BenchContext) -> list[tuple[str, tuple[int, int, int]]]:
    memory_bound = (1024, 2048, 1024) if ctx.quick else (2048, 4096, 2048)
    models = [("memory-bound", memory_bound)]
    if not ctx.quick:
        models.append(("call-bound", (256, 1024, 256)))
    return models


def run(ctx: BenchContext) -> list[Row]:
    rows: list[Row] = []
    with local_cluster(WORKERS, "--allow-factory", "collectives_server.model_zoo") as address:
        clients = [collectives.connect(address, timeout=60) for _ in range(CALLERS)]
        try:
            for kind, dims in _models(ctx):
                rows.extend(_rows_of(ctx, clients, kind, dims))
        finally:
            for c in clients:
                c.close()
    return rows


def _rows_of(
    ctx: BenchContext,
    clients: list[collectives.Cluster],
    kind: str,
    dims: tuple[int, int, int],
) -> list[Row]:
    kwargs = {"in_features": dims[0], "hidden": dims[1], "out_features": dims[2], "depth": 1}
    weights_mib = sum(p.numel() * 4 for p in mlp(**kwargs).parameters()) / 2**20
    label = f"MLP {'-'.join(map(str, dims))} ({kind}, {weights_mib:.0f} MiB)"
    window_s = 1.0 if ctx.quick else 3.0
    windows = 1 if ctx.quick else 2
    sizes = (1,) if ctx.quick else (1, 4)
    reference = mlp(**kwargs).eval()
    names = {path: f"bench-fleet-{path}" for _, path in PATHS}
    for path, name in names.items():
        clients[0].load_model(
            name,
            factory=FACTORY,
            kwargs=kwargs,
            batching=BATCHING if path.endswith("batched") else None,
        )
        clients[0].data_parallel(name).eval()
        if path.startswith("rank0"):
            clients[0].step(name, lr=0.0)  # the replicas may differ now: no routing
    floor = FloorFanout(kwargs, WORKERS)
    floor_clients = [floor.client(spread=True) for _ in range(CALLERS)]
    rows: list[Row] = []
    try:
        for size in sizes:
            x = torch.randn(size, dims[0])
            measured, floor_tput = _measure(
                clients, floor_clients, names, x, reference(x).detach(), window_s, windows
            )
            what = f"{CALLERS} callers, {size}-row requests, {label}, {WORKERS} workers"
            base_label, base = PATHS[0][0], measured[PATHS[0][1]]
            memory_bound_one = kind == "memory-bound" and size == 1
            targets = {
                "routed-batched": ">= 3" if memory_bound_one else "",
                "routed-plain": "",
                "rank0-batched": "",
            }
            for text, path in PATHS[1:]:
                rows.append(
                    _row(
                        f"rows/s, {text}, {what}",
                        measured[path],
                        f"{base_label} (the path before routing)",
                        base,
                        targets[path],
                    )
                )
            rows.append(
                _row(
                    f"rows/s, routed: batching on vs off, {what}",
                    measured["routed-batched"],
                    "routed, batching off",
                    measured["routed-plain"],
                    ">= 2" if memory_bound_one else "",
                    extra_note=_p99_note(measured["routed-batched"], measured["routed-plain"]),
                )
            )
            rows.append(
                _row(
                    f"rows/s, routed, batching off, {what}",
                    measured["routed-plain"],
                    "gRPC fan-out floor, parts spread round-robin",
                    floor_tput,
                    "",
                )
            )
            if memory_bound_one:
                rows.append(_ceiling_row(reference, dims[0], label, base, window_s, windows))
    finally:
        for fc in floor_clients:
            fc.close()
        floor.close()
        for name in names.values():
            clients[0].unload_model(name, missing_ok=True)
    return rows


def _ceiling_row(
    reference: torch.nn.Module,
    width: int,
    label: str,
    base: _Load,
    window_s: float,
    windows: int,
) -> Row:
    """The most rows/s batching can give the 1-row callers on this machine: the model's
    own forward of ``CALLERS`` rows (the largest batch they can merge into), run here
    with every core and no call around it. Routed + batching can reach at most this;
    where it is under 3x the rank-0 path, the >= 3 target is out of this machine's
    reach, whatever the service does."""
    x = torch.randn(CALLERS, width)

    def forward(_caller: object) -> torch.Tensor:
        with torch.no_grad():
            return reference(x)

    ceiling = _under_load(forward, [None], window_s, windows, CALLERS)
    ratio = statistics.median(ceiling.rates) / statistics.median(base.rates)
    verdict = "reachable" if ratio >= 3 else "out of reach here"
    return _row(
        f"rows/s ceiling: the model's own forward of {CALLERS} rows, {label}, "
        f"{torch.get_num_threads()} threads, no service",
        ceiling,
        f"{PATHS[0][0]} (the path before routing)",
        base,
        "",
        extra_note=f"routed + batching >= 3x the anchor is {verdict} ({ratio:.2f}x here)",
    )


def _measure(
    clients: list[collectives.Cluster],
    floor_clients: list,
    names: dict[str, str],
    x: torch.Tensor,
    expected: torch.Tensor,
    window_s: float,
    windows: int,
) -> tuple[dict[str, _Load], _Load]:
    """Each path's load figures with 8 callers sending ``x``, and the floor's."""
    dps = {path: {id(c): c.data_parallel(name) for c in clients} for path, name in names.items()}

    def call_of(path: str) -> Callable[[collectives.Cluster], torch.Tensor]:
        def call(client: collectives.Cluster) -> torch.Tensor:
            with torch.no_grad():
                return dps[path][id(client)](x)

        return call

    for path in names:
        for client in clients:  # every caller's connections open, outputs right
            if not torch.allclose(call_of(path)(client), expected, atol=1e-4, rtol=1e-4):
                raise AssertionError(f"dp(x) on the {path} path differs from model(x)")
    rows = x.shape[0]
    measured = {
        path: _under_load(call_of(path), clients, window_s, windows, rows) for path in names
    }
    return measured, _under_load(lambda c: c.forward(x), floor_clients, window_s, windows, rows)


class _Load:
    """What :func:`_under_load` measured: rows/s per window and every call's latency."""

    def __init__(self, rates: list[float], latencies: list[float]) -> None:
        self.rates = rates
        self.latencies = sorted(latencies)

    def latency(self, q: float) -> float:
        return self.latencies[min(len(self.latencies) - 1, round(q * (len(self.latencies) - 1)))]


def _under_load(
    call: Callable, callers: list, window_s: float, windows: int, rows_per_call: int
) -> _Load:
    """Rows/s of ``call(caller)`` run in a loop by one thread per caller for ``window_s``
    (``windows`` times), and the latency of every call made."""
    rates: list[float] = []
    latencies: list[float] = []
    for _ in range(windows):
        rate, seen = _window(call, callers, window_s, rows_per_call)
        rates.append(rate)
        latencies.extend(seen)
    return _Load(rates, latencies)


def _window(
    call: Callable, callers: list, window_s: float, rows_per_call: int
) -> tuple[float, list[float]]:
    """One window of :func:`_under_load`: rows/s and the calls' latencies."""
    counts = [0] * len(callers)
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(len(callers) + 1)
    stop_at = time.perf_counter() + window_s + 1.0  # set again when all are ready

    def loop(i: int) -> None:
        mine: list[float] = []
        try:
            start.wait()
            while (began := time.perf_counter()) < stop_at:
                call(callers[i])
                mine.append(time.perf_counter() - began)
                counts[i] += rows_per_call
        except BaseException as exc:  # reported after the window
            errors.append(exc)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(callers))]
    for t in threads:
        t.start()
    stop_at = time.perf_counter() + window_s
    began = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return sum(counts) / elapsed, latencies


def _p99_note(on: _Load, off: _Load) -> str:
    ratio = on.latency(0.99) / off.latency(0.99)
    verdict = "met" if ratio <= 1.0 else "NOT met"
    return f"p99 of a call, batching on / off: {ratio:.2f} (target <= 1.0: {verdict})"


def _row(
    what: str, service: _Load, anchor_name: str, anchor: _Load, target: str, extra_note: str = ""
) -> Row:
    def ms(load: _Load) -> str:
        return f"p50 {load.latency(0.5) * 1e3:.1f} ms, p99 {load.latency(0.99) * 1e3:.1f} ms"

    note = f"a call under load: {ms(service)} (anchor {ms(anchor)})"
    return Row(
        group=GROUP,
        what=what,
        service=stat_of(service.rates, "rows/s"),
        anchor_name=anchor_name,
        anchor=stat_of(anchor.rates, "rows/s"),
        target=target,
        note=f"{note}; {extra_note}" if extra_note else note,
        extra={
            "callers": CALLERS,
            "latency_p50_s": service.latency(0.5),
            "latency_p99_s": service.latency(0.99),
            "anchor_latency_p50_s": anchor.latency(0.5),
            "anchor_latency_p99_s": anchor.latency(0.99),
            "calls": len(service.latencies),
            "median_rate": statistics.median(service.rates),
        },
    )
