"""Inference fan-out beside its floor: ``dp(x)`` against a hand-written gRPC fan-out.

For two MLPs of the model zoo (call-bound 256-1024-256 and compute-bound
1024-4096-1024, one hidden layer, eval mode), batch 64 over 2 workers:

- the floor (:mod:`bench.direct_fanout`): 2 processes each serving the same
  eager module over one generic unary gRPC method, raw float32 bytes in and
  out, one call per shard from a thread of the caller's pool, the torch
  threads the local cluster's workers get;
- the service: ``dp = cluster.data_parallel(name)`` on a local cluster of 2
  workers, the model loaded by factory, ``dp(x)`` under ``torch.no_grad()``;
  once loaded plainly (batching off) and once with
  ``Batching(max_rows=256, max_delay_ms=1.0)``.

Rows: latency p50/p99 of one call, and samples/s with 1 and 8 callers (each its
own client and channels), batching off and on. The batching-on row's note gives
what merging can save at most, measured in the same run: the model alone on one
torch thread, 8 forwards of one 8-caller batch's shard rows against one forward
of all those rows (merging saves model time only; each call's own work stays).
Targets for the call-bound model: latency <= 1.15x the floor; 8 callers >= 0.9x
the floor's samples/s with batching off and >= 1.2x with it on (the floor cannot
merge callers). For the compute-bound one: within 5 % of the floor.
"""

from __future__ import annotations

import statistics
import time

import torch

import collectives
from collectives_server.model_zoo import mlp

from .core import BenchContext, Row, measure, shared_cluster, stat_of, throughput
from .direct_fanout import FloorFanout

NAME = "inference_floor"
BATCH = 64
WORKERS = 2
FACTORY = "collectives_server.model_zoo:mlp"
CALLERS = 8
MERGE_REPEATS = 30
GROUP = "5b inference floor"


def _sizes(ctx: BenchContext) -> list[tuple[str, tuple[int, int, int]]]:
    return [("call-bound", (256, 1024, 256)), ("compute-bound", (1024, 4096, 1024))]


def run(ctx: BenchContext) -> list[Row]:
    rows: list[Row] = []
    for kind, dims in _sizes(ctx):
        rows.extend(_rows_of(ctx, kind, dims))
    return rows


def _rows_of(ctx: BenchContext, kind: str, dims: tuple[int, int, int]) -> list[Row]:
    kwargs = {"in_features": dims[0], "hidden": dims[1], "out_features": dims[2], "depth": 1}
    call_bound = kind == "call-bound"
    window_s = 1.5 if ctx.quick else 4.0
    latency_n = (60 if ctx.quick else 200) if call_bound else (20 if ctx.quick else 60)
    windows = 2 if ctx.quick else 3
    label = f"MLP {'-'.join(map(str, dims))} ({kind}), batch {BATCH}, {WORKERS} workers"
    x = torch.randn(BATCH, dims[0])
    reference = mlp(**kwargs).eval()
    expected = reference(x).detach()
    merge_note = _merge_ceiling(reference, x[: BATCH // WORKERS], CALLERS, MERGE_REPEATS)
    rows: list[Row] = []
    floor = FloorFanout(kwargs, WORKERS)
    floor_clients = [floor.client() for _ in range(CALLERS)]
    address = shared_cluster(WORKERS)
    clients = [collectives.connect(address, timeout=60) for _ in range(CALLERS)]
    names = {False: "bench-floor-plain", True: "bench-floor-batched"}
    try:
        if not torch.allclose(floor_clients[0].forward(x), expected, atol=1e-5, rtol=1e-4):
            raise AssertionError("the floor's output differs from model(x)")
        for batched, name in names.items():
            clients[0].load_model(
                name,
                factory=FACTORY,
                kwargs=kwargs,
                batching=collectives.Batching(max_rows=4 * BATCH, max_delay_ms=1.0)
                if batched
                else None,
            )
            clients[0].data_parallel(name).eval()
        dps = {
            batched: {id(c): c.data_parallel(name) for c in clients}
            for batched, name in names.items()
        }

        def floor_call(client) -> torch.Tensor:
            return client.forward(x)

        def remote(batched: bool):
            def call(client) -> torch.Tensor:
                with torch.no_grad():
                    return dps[batched][id(client)](x)

            return call

        for batched in names:
            if not torch.allclose(remote(batched)(clients[0]), expected, atol=1e-5, rtol=1e-4):
                raise AssertionError("dp(x) differs from model(x)")

        def tput(call, callers: list) -> object:
            return stat_of(
                [throughput(call, callers, window_s, BATCH) for _ in range(windows)],
                "samples/s",
            )

        floor_latency = measure(lambda: floor_call(floor_clients[0]), latency_n, warmup=5)
        service_latency = measure(lambda: remote(False)(clients[0]), latency_n, warmup=5)
        rows.append(
            Row(
                group=GROUP,
                what=f"dp(x) latency, {label}",
                service=service_latency,
                anchor_name="hand-written gRPC fan-out (raw bytes, one call per shard)",
                anchor=floor_latency,
                target="<= 1.15" if call_bound else "<= 1.05",
                note=f"p99/p50 of dp(x): {service_latency.p99 / service_latency.median:.2f}",
            )
        )
        floor_one = tput(floor_call, floor_clients[:1])
        rows.append(
            Row(
                group=GROUP,
                what=f"dp(x) samples/s, 1 caller, {label}",
                service=tput(remote(False), clients[:1]),
                anchor_name="the floor, 1 caller",
                anchor=floor_one,
                target="" if call_bound else ">= 0.95",
                extra={"callers": 1, "batch": BATCH, "window_s": window_s},
            )
        )
        floor_many = tput(floor_call, floor_clients)
        for batched in names:
            rows.append(
                Row(
                    group=GROUP,
                    what=(
                        f"dp(x) samples/s, {CALLERS} callers, batching "
                        f"{'on' if batched else 'off'}, {label}"
                    ),
                    service=tput(remote(batched), clients),
                    anchor_name=f"the floor, {CALLERS} callers",
                    anchor=floor_many,
                    target=(">= 1.2" if batched else ">= 0.9") if call_bound else ">= 0.95",
                    note=(
                        f"batching: Batching(max_rows=256, max_delay_ms=1.0); {merge_note}"
                        if batched
                        else ""
                    ),
                    extra={"callers": CALLERS, "batch": BATCH, "window_s": window_s},
                )
            )
        for name in names.values():
            clients[0].unload_model(name, missing_ok=True)
    finally:
        for c in clients:
            c.close()
        for fc in floor_clients:
            fc.close()
        floor.close()
    return rows


def _merge_ceiling(model: torch.nn.Module, shard: torch.Tensor, callers: int, repeats: int) -> str:
    """What merging ``callers`` shards like ``shard`` saves of the model's own time at
    most: ``callers`` forwards of ``shard`` against one of them all concatenated, on
    one torch thread (a local worker's), medians of ``repeats``."""
    merged = torch.cat([shard] * callers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    separate: list[float] = []
    together: list[float] = []
    try:
        with torch.inference_mode():
            for i in range(repeats + 3):  # taking turns, the first 3 as warmup
                started = time.perf_counter()
                for _ in range(callers):
                    model(shard)
                middle = time.perf_counter()
                model(merged)
                if i >= 3:
                    separate.append(middle - started)
                    together.append(time.perf_counter() - middle)
    finally:
        torch.set_num_threads(threads)
    apart, merged_s = statistics.median(separate), statistics.median(together)
    saved = 1.0 - merged_s / apart
    return (
        f"merging {callers} shards of {shard.shape[0]} rows saves at most {saved:.0%} of the "
        f"model's time ({apart * 1e6 / callers:.0f} -> {merged_s * 1e6 / callers:.0f} "
        "us per shard, one thread)"
    )
