"""The floor of the inference rows: a minimal hand-written gRPC fan-out of one model.

``FloorFanout(kwargs, world)`` spawns ``world`` processes of::

    python -m bench.direct_fanout --kwargs JSON

each a gRPC server (one generic unary method, ``/floor.Fanout/Forward``) holding
the model zoo's MLP built from ``kwargs`` in eval mode, eager, with the torch
threads the service's local workers get (``OMP_NUM_THREADS``: the cores shared
among the workers). A request is the raw float32 bytes of a shard's rows, the
response the raw bytes of its output rows: no names, no value tree, no version,
no store. ``FloorFanout.client().forward(x)`` splits ``x`` along dim 0 like the SDK
(``torch.tensor_split``), sends one blocking unary call per shard, each from a
thread of the client's own pool so that all are in flight at once, and
concatenates the answers: what any fan-out of this model over gRPC must at
least pay. (The pool, not ``grpc`` futures: a future on an idle channel starts
a thread of gRPC's for each call, which costs more than a small call: measured
side by side, concurrent callers get more samples/s through the pool.)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FloorClient", "FloorFanout", "FloorTls"]

_ROOT = Path(__file__).resolve().parent.parent
_METHOD = "/floor.Fanout/Forward"
_TIMEOUT_S = 60.0


def _identity(b: bytes) -> bytes:
    return b


@dataclass(frozen=True)
class FloorTls:
    """TLS for the floor: the servers' certificate and key, the clients' CA, and a
    bearer token the clients send on every call (as a TLS + token client of the
    service does; the floor's servers do not check it)."""

    cert: Path
    key: Path
    ca: Path
    token: str


class FloorFanout:
    """``world`` floor servers of the MLP built from ``kwargs`` (close them when done),
    over TLS with ``tls``."""

    def __init__(self, kwargs: dict, world: int, tls: FloorTls | None = None) -> None:
        self.kwargs = kwargs
        self.tls = tls
        threads = max(1, (os.cpu_count() or 1) // world)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        self._procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        try:
            for _ in range(world):
                self._procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "bench.direct_fanout",
                            "--kwargs",
                            json.dumps(kwargs),
                            *(
                                ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
                                if tls is not None
                                else []
                            ),
                        ],
                        cwd=_ROOT,
                        env=env,
                        stdout=subprocess.PIPE,
                        stdin=subprocess.DEVNULL,
                        text=True,
                    )
                )
            for proc in self._procs:
                line = proc.stdout.readline().strip() if proc.stdout else ""
                if not line.isdigit():
                    raise RuntimeError("a floor server did not start")
                self.addresses.append(f"127.0.0.1:{line}")
        except BaseException:
            self.close()
            raise

    def client(self, *, spread: bool = False) -> FloorClient:
        """A caller with channels of its own (as each SDK client has); ``spread``: a
        batch of fewer rows than servers goes to the servers in turn (round-robin, as a
        load balancer would), not always to the first."""
        return FloorClient(
            self.addresses, int(self.kwargs["out_features"]), self.tls, spread=spread
        )

    def close(self) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class FloorClient:
    """One caller of the floor servers: a channel to each."""

    def __init__(
        self,
        addresses: list[str],
        out_features: int,
        tls: FloorTls | None = None,
        *,
        spread: bool = False,
    ) -> None:
        import grpc

        self._out_features = out_features
        self._spread = spread
        self._turn = itertools.count()
        self._pool = futures.ThreadPoolExecutor(max_workers=len(addresses))
        if tls is None:
            self._channels = [grpc.insecure_channel(a) for a in addresses]
        else:
            credentials = grpc.composite_channel_credentials(
                grpc.ssl_channel_credentials(tls.ca.read_bytes()),
                grpc.access_token_call_credentials(tls.token),
            )
            self._channels = [grpc.secure_channel(a, credentials) for a in addresses]
        for channel in self._channels:
            grpc.channel_ready_future(channel).result(timeout=_TIMEOUT_S)
        self._calls = [
            c.unary_unary(_METHOD, request_serializer=_identity, response_deserializer=_identity)
            for c in self._channels
        ]

    def forward(self, x):
        """The model's output on ``x`` (float32, rows on dim 0), one call per shard."""
        import torch

        shards = [s for s in torch.tensor_split(x, len(self._calls)) if s.shape[0]]
        first = next(self._turn) if self._spread else 0
        calls = [self._calls[(first + i) % len(self._calls)] for i in range(len(shards))]
        pending = [
            self._pool.submit(call, s.contiguous().numpy().tobytes(), timeout=_TIMEOUT_S)
            for call, s in zip(calls, shards, strict=True)
        ]
        outs = [
            torch.frombuffer(bytearray(p.result()), dtype=torch.float32).view(
                -1, self._out_features
            )
            for p in pending
        ]
        return torch.cat(outs)

    def close(self) -> None:
        self._pool.shutdown()
        for channel in self._channels:
            channel.close()


def _serve(kwargs: dict, tls_cert: str | None, tls_key: str | None) -> None:
    import grpc
    import torch

    from collectives_server.model_zoo import mlp

    model = mlp(**kwargs).eval()
    in_features = int(kwargs["in_features"])

    def forward(request: bytes, context) -> bytes:
        x = torch.frombuffer(bytearray(request), dtype=torch.float32).view(-1, in_features)
        with torch.no_grad():
            return model(x).numpy().tobytes()

    handler = grpc.method_handlers_generic_handler(
        "floor.Fanout",
        {
            "Forward": grpc.unary_unary_rpc_method_handler(
                forward, request_deserializer=_identity, response_serializer=_identity
            )
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20),
        ],
    )
    server.add_generic_rpc_handlers((handler,))
    if tls_cert and tls_key:
        credentials = grpc.ssl_server_credentials(
            [(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())]
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kwargs", required=True, help="the MLP's factory kwargs (JSON)")
    parser.add_argument("--tls-cert", help="serve over TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="and this key (PEM)")
    args = parser.parse_args()
    _serve(json.loads(args.kwargs), args.tls_cert, args.tls_key)


if __name__ == "__main__":
    main()
