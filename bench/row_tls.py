"""A secure deployment's fast road: TLS and a bearer token on every channel.

A local cluster of 2 workers with ``--tls-cert``/``--tls-key`` and ``--token-file``
(a throwaway CA, :mod:`bench.pki`); the SDK connects with the CA and the token,
so its calls ride TLS call lanes on the workers' bulk ports. Beside it, in the
same run:

- ``dp(x)`` of the call-bound MLP 256-1024-256 (one hidden layer, eval mode),
  batch 64, against the floor of :mod:`bench.direct_fanout` over TLS with the
  same certificate and the token on every call: a minimal TLS gRPC fan-out of
  the same model (target: <= 1.15x);
- a 4 B all_reduce against a TLS gRPC empty round trip to a worker plus twice a
  direct gloo 4 B all_reduce, the plaintext latency row's anchor under TLS.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import grpc
import torch

import collectives
from collectives_server.model_zoo import mlp

from .anchors import all_reduce_seconds, gloo_all_reduce, grpc_empty_rtt, percentile
from .core import BenchContext, Row, Stat, local_cluster, measure
from .direct_fanout import FloorFanout, FloorTls
from .pki import make_pki

NAME = "tls"
GROUP = "4b TLS + token"
BATCH = 64
WORKERS = 2
DIMS = (256, 1024, 256)
FACTORY = "collectives_server.model_zoo:mlp"


def run(ctx: BenchContext) -> list[Row]:
    kwargs = {"in_features": DIMS[0], "hidden": DIMS[1], "out_features": DIMS[2], "depth": 1}
    latency_n = 60 if ctx.quick else 200
    samples = 100 if ctx.quick else 1000
    with tempfile.TemporaryDirectory(prefix="collectives-bench-tls-") as directory:
        pki = make_pki(Path(directory))
        flags = (
            f"--tls-cert={pki.cert}",
            f"--tls-key={pki.key}",
            f"--tls-ca={pki.ca}",
            f"--token-file={pki.token_file}",
            "--allow-factory",
            "collectives_server.model_zoo",
        )
        floor = FloorFanout(kwargs, WORKERS, FloorTls(pki.cert, pki.key, pki.ca, pki.token))
        floor_client = floor.client()
        try:
            with (
                local_cluster(WORKERS, *flags) as address,
                collectives.connect(
                    address, timeout=60, tls_ca=str(pki.ca), token=pki.token
                ) as cluster,
            ):
                return _rows(cluster, floor_client, pki, kwargs, latency_n, samples)
        finally:
            floor_client.close()
            floor.close()


def _rows(cluster, floor_client, pki, kwargs, latency_n: int, samples: int) -> list[Row]:
    x = torch.randn(BATCH, DIMS[0])
    expected = mlp(**kwargs).eval()(x).detach()
    cluster.load_model("bench-tls", factory=FACTORY, kwargs=kwargs)
    dp = cluster.data_parallel("bench-tls")
    dp.eval()

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return dp(x)

    for output in (forward(), floor_client.forward(x)):
        if not torch.allclose(output, expected, atol=1e-5, rtol=1e-4):
            raise AssertionError("an output over TLS differs from model(x)")
    floor_latency = measure(lambda: floor_client.forward(x), latency_n, warmup=5)
    service_latency = measure(forward, latency_n, warmup=5)
    rows = [
        Row(
            group=GROUP,
            what=f"dp(x) latency, MLP {'-'.join(map(str, DIMS))}, batch {BATCH}, "
            f"{WORKERS} workers, TLS + token",
            service=service_latency,
            anchor_name="hand-written TLS gRPC fan-out (token, raw bytes, one call per shard)",
            anchor=floor_latency,
            target="<= 1.15",
        )
    ]

    service = [1e3 * s for s in all_reduce_seconds(cluster, "bench/tls-latency", samples)]
    worker = next(w for w in cluster.workers() if w.rank == 0)
    credentials = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    rtt = [1e3 * s for s in grpc_empty_rtt(worker.address, samples, credentials)]
    gloo = [1e3 * s for s in gloo_all_reduce(4, samples)]
    rtt50, gloo50 = percentile(rtt, 50), percentile(gloo, 50)
    p50, p99 = percentile(service, 50), percentile(service, 99)
    rows.append(
        Row(
            group=GROUP,
            what="all_reduce 4 B, world 2, p50, TLS + token",
            service=Stat(p50, min(service), max(service), "ms", samples, p99),
            anchor_name="TLS gRPC empty RTT p50 + 2x direct gloo 4 B all_reduce p50",
            anchor=Stat(
                rtt50 + 2 * gloo50,
                min(rtt) + 2 * min(gloo),
                max(rtt) + 2 * max(gloo),
                "ms",
                samples,
            ),
            target="<= 1.0",
            note=f"p99 {p99:.3g} ms; anchor parts: TLS gRPC RTT p50 {rtt50:.3g} ms, "
            f"gloo 4 B p50 {gloo50:.3g} ms",
        )
    )
    return rows
