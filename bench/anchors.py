"""Anchors: what the machine itself does, measured in the same run as the service.

- :class:`TcpSink`: raw TCP loopback into a preallocated buffer (a server thread
  ``recv_into``s a preallocated ``bytearray`` and acks each transfer; the client
  ``sendall``s a memoryview of the tensor, so neither side copies); with
  ``fresh=True`` into a new buffer each transfer (as the SDK allocates one:
  huge-page advised, its pages faulted in by the receive), which is what a
  receiver that keeps what it receives pays.
- :func:`memcpy_gbps`: ``dst.copy_(src)`` between two preallocated CPU tensors.
- :func:`grpc_empty_rtt`: one empty gRPC round trip (``grpc.health.v1`` Check).
- :func:`gloo_all_reduce`: a direct ``torch.distributed`` gloo all_reduce in two
  fresh processes (``python -m bench.anchors gloo ...``), built like the workers
  build theirs (``ProcessGroupGloo(PrefixStore(...), rank, size, timeout)``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .core import Stat, measure

__all__ = ["TcpSink", "memcpy_gbps", "grpc_empty_rtt", "gloo_all_reduce", "percentile"]

_HEADER = struct.Struct("!Q")
_REPO_ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by nearest rank on the sorted values."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class TcpSink:
    """A loopback TCP server thread receiving into one preallocated buffer.

    Each transfer is an 8-byte length header then the payload; the server
    ``recv_into``s the payload into its buffer and answers one byte. The
    connection stays open between transfers (like a warm gRPC channel).
    """

    def __init__(self, capacity: int, fresh: bool = False) -> None:
        self._fresh = fresh
        self._buffer = memoryview(bytearray(0 if fresh else capacity))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, name="tcp-sink", daemon=True)
        self._thread.start()
        self._client = socket.create_connection(self._listener.getsockname())
        self._client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                header = _recv_exactly(conn, memoryview(bytearray(_HEADER.size)))
                if header is None:
                    return
                (n,) = _HEADER.unpack(header)
                if self._fresh:
                    from collectives.wire.memory import empty_bytes

                    kept = empty_bytes(n)
                    into = memoryview(kept.numpy()).cast("B")
                else:
                    into = self._buffer[:n]
                if _recv_exactly(conn, into) is None:
                    return
                conn.sendall(b"\x01")

    def send(self, payload: memoryview) -> None:
        """Sends ``payload`` and waits for the server's ack."""
        self._client.sendall(_HEADER.pack(payload.nbytes))
        self._client.sendall(payload)
        if not self._client.recv(1):
            raise RuntimeError("tcp sink closed")

    def gbps(self, t: torch.Tensor, repeats: int) -> Stat:
        """GB/s of sending ``t``'s bytes, median of ``repeats``."""
        payload = memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
        n = payload.nbytes
        return measure(lambda: self.send(payload), repeats, unit="GB/s", per=lambda s: n / s / 1e9)

    def close(self) -> None:
        self._client.close()
        self._listener.close()
        self._thread.join(5)

    def __enter__(self) -> TcpSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recv_exactly(conn: socket.socket, view: memoryview) -> memoryview | None:
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return view


def memcpy_gbps(nbytes: int, repeats: int) -> Stat:
    """GB/s of ``dst.copy_(src)`` between two preallocated CPU byte tensors."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), repeats, unit="GB/s", per=lambda s: nbytes / s / 1e9)


def all_reduce_seconds(cluster: Any, name: str, samples: int) -> list[float]:
    """Seconds of each of ``samples`` ``cluster.all_reduce`` calls of a 4-byte tensor
    stored as ``name`` on every rank (after a warm-up); the tensor is deleted after."""
    import torch

    cluster.put(name, torch.ones(1, dtype=torch.float32))  # every rank
    for _ in range(max(10, samples // 10)):
        cluster.all_reduce(name, op="max")
    values = []
    for _ in range(samples):
        started = time.perf_counter()
        cluster.all_reduce(name, op="max")
        values.append(time.perf_counter() - started)
    cluster.delete(name, missing_ok=True)
    return values


def grpc_empty_rtt(address: str, samples: int, credentials: Any = None) -> list[float]:
    """Seconds of ``samples`` health Check round trips to the gRPC server at ``address``
    (through TLS with ``credentials``, a ``grpc.ChannelCredentials``, when given)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        for _ in range(max(10, samples // 10)):  # connect and warm up
            stub.Check(request, timeout=10)
        values = []
        for _ in range(samples):
            started = time.perf_counter()
            stub.Check(request, timeout=10)
            values.append(time.perf_counter() - started)
    return values


def gloo_all_reduce(
    nbytes: int, samples: int, world: int = 2, timeout_s: float = 120.0
) -> list[float]:
    """Seconds of each of ``samples`` direct gloo all_reduces of ``nbytes`` (float32) in
    ``world`` fresh processes, as rank 0 timed them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.anchors",
                "gloo",
                f"--rank={rank}",
                f"--world={world}",
                f"--port={port}",
                f"--nbytes={nbytes}",
                f"--samples={samples}",
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=_REPO_ROOT,
            env=env,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"gloo anchor process exited {proc.returncode}")
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return json.loads(outputs[0].strip().splitlines()[-1])["seconds"]


def _gloo_main(args: argparse.Namespace) -> None:
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world, args.rank == 0, timeout=timeout, wait_for_workers=False
    )
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), args.rank, args.world, timeout)
    t = torch.ones(max(1, args.nbytes // 4), dtype=torch.float32)
    for _ in range(max(10, args.samples // 10)):
        group.allreduce([t]).wait()
    values = []
    for _ in range(args.samples):
        started = time.perf_counter()
        group.allreduce([t]).wait()
        values.append(time.perf_counter() - started)
    group.barrier().wait()
    print(json.dumps({"rank": args.rank, "seconds": values}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.anchors")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gloo = sub.add_parser("gloo", help="one rank of the direct gloo all_reduce anchor")
    gloo.add_argument("--rank", type=int, required=True)
    gloo.add_argument("--world", type=int, default=2)
    gloo.add_argument("--port", type=int, required=True)
    gloo.add_argument("--nbytes", type=int, default=4)
    gloo.add_argument("--samples", type=int, default=100)
    args = parser.parse_args(argv)
    if args.cmd == "gloo":
        _gloo_main(args)


if __name__ == "__main__":
    main()
