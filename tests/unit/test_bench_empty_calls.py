"""bench/empty_calls.py against a real gRPC health server on loopback."""

from __future__ import annotations

import socket
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.concurrent_clients import Plan
from bench.empty_calls import empty_call_rates


class _Counting(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.endswith("/Check"):
            with self._lock:
                self.calls += 1
        return continuation(handler_call_details)


def test_every_caller_makes_its_calls_in_every_round() -> None:
    counting = _Counting()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[counting])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # max_ops ends each round, not the (long) duration: 3 callers x (2 warm-up + 2 x 15).
        plan = Plan(rounds=2, duration_s=60.0, max_ops=15, warmup=2)
        rates = empty_call_rates(f"127.0.0.1:{port}", 3, plan)
        assert len(rates) == 2 and all(r > 0 for r in rates)
        assert counting.calls == 3 * (2 + 2 * 15)
    finally:
        server.stop(None)


def test_an_unreachable_server_raises_instead_of_hanging() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(grpc.RpcError):
        empty_call_rates(f"127.0.0.1:{port}", 2, Plan(rounds=1, duration_s=0.1, max_ops=5))
