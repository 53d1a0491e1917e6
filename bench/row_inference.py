"""Row 5: fan-out inference ``dp(x)`` against local ``model(x)`` in this process.

An MLP (full: 1024-4096-1024, ~8.4 M parameters; quick: 256-1024-256) is loaded
on a local cluster of 2 workers by factory (the server's model zoo), and the
same module is built here with the same seed. ``dp = cluster.data_parallel``
splits each batch of 64 across the 2 workers, uploads the shards, runs
``Forward`` on both and gathers the outputs.

- latency: one ``dp(x)`` (batch 64, no grad) vs one local ``model(x)``;
- throughput: samples/s with 1 and 8 concurrent clients (threads, each with its
  own ``collectives.connect``), each calling ``dp(x)`` in a loop for a fixed
  window, vs the local model's throughput in a loop in this process.

No target: per call the service pays a gRPC round trip per rank for the
upload, the Forward and the download (3 RTTs, ~1 ms each, on every worker in
parallel) plus the framing, so for a model this small the fan-out is bounded
by RPC latency, not compute; concurrent clients hide it until the workers'
cores (shared with the clients on one machine) saturate.
"""

from __future__ import annotations

import torch

import collectives
from collectives_server.model_zoo import mlp

from .core import BenchContext, Row, measure, shared_cluster, stat_of, throughput

NAME = "inference"
BATCH = 64
FACTORY = "collectives_server.model_zoo:mlp"


def run(ctx: BenchContext) -> list[Row]:
    dims = (256, 1024, 256) if ctx.quick else (1024, 4096, 1024)
    kwargs = {"in_features": dims[0], "hidden": dims[1], "out_features": dims[2], "depth": 1}
    window_s = 1.5 if ctx.quick else 5.0
    latency_n = 50 if ctx.quick else 100
    windows = 3 if ctx.quick else ctx.repeats
    model = mlp(**kwargs).eval()
    x = torch.randn(BATCH, dims[0])

    def local(_client: object = None) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    anchor_latency = measure(local, latency_n, warmup=3, unit="s")
    anchor_tput = stat_of(
        [throughput(local, [None], window_s, BATCH) for _ in range(windows)], "samples/s"
    )
    label = "-".join(map(str, dims))
    rows: list[Row] = []
    address = shared_cluster(2)
    # The shared cluster outlives this row; the model is unloaded below.
    clients = [collectives.connect(address, timeout=60) for _ in range(8)]
    try:
        clients[0].load_model("bench-mlp", factory=FACTORY, kwargs=kwargs)
        dps = {id(c): c.data_parallel("bench-mlp") for c in clients}

        def remote(client) -> torch.Tensor:
            with torch.no_grad():
                return dps[id(client)](x)

        out = remote(clients[0])
        if not torch.allclose(out, local(), atol=1e-5, rtol=1e-4):
            raise AssertionError("dp(x) differs from model(x)")
        latency = measure(lambda: remote(clients[0]), latency_n, warmup=3, unit="s")
        rows.append(
            Row(
                group="5 inference",
                what=f"dp(x) latency, MLP {label}, batch {BATCH}, 2 workers",
                service=latency,
                anchor_name="local model(x) in this process",
                anchor=anchor_latency,
                note="bound: one Forward RPC per rank (tensors inline) vs a matmul chain",
            )
        )
        for n in (1, 8):
            tput = stat_of(
                [throughput(remote, clients[:n], window_s, BATCH) for _ in range(windows)],
                "samples/s",
            )
            rows.append(
                Row(
                    group="5 inference",
                    what=f"dp(x) throughput, {n} client{'s' if n > 1 else ''}, MLP {label}",
                    service=tput,
                    anchor_name="local model(x) throughput, this process",
                    anchor=anchor_tput,
                    note="ratio > 1 is better; clients and workers share this machine's cores",
                    extra={"clients": n, "batch": BATCH, "window_s": window_s},
                )
            )
        clients[0].unload_model("bench-mlp", missing_ok=True)
    finally:
        for c in clients:
            c.close()
    return rows
