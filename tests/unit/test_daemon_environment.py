"""What the daemons set in their environment on import, before torch and grpc read it."""

from __future__ import annotations

import os
import subprocess
import sys

import collectives_server

# A daemon's first imports, then one real gRPC call over loopback: grpc parses
# GRPC_EXPERIMENTS when it starts, and logs an unknown experiment name there.
_PROBE = """
import os
import collectives_server
import grpc
from concurrent import futures
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
server.stop(None)
print(reply.status == health_pb2.HealthCheckResponse.SERVING)
print(repr(os.environ.get("GRPC_EXPERIMENTS")))
print(repr(os.environ.get("THP_MEM_ALLOC_ENABLE")))
"""


def _probe(**env: str) -> tuple[list[str], str]:
    ours = ("GRPC_EXPERIMENTS", "THP_MEM_ALLOC_ENABLE")
    base = {k: v for k, v in os.environ.items() if k not in ours}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.splitlines(), done.stderr


def test_a_daemon_runs_grpc_without_its_event_engine_and_grpc_knows_the_names() -> None:
    out, err = _probe()
    assert out == ["True", repr(collectives_server.GRPC_EXPERIMENTS), "'1'"]
    assert "-event_engine_listener" in collectives_server.GRPC_EXPERIMENTS
    # A grpcio that no longer has these experiments says so at start-up: then the
    # setting does nothing and should go (docs/perf-log.md, "gRPC without its EventEngine").
    assert "Unknown experiment" not in err, err


def test_what_the_user_exported_is_kept() -> None:
    out, _ = _probe(GRPC_EXPERIMENTS="", THP_MEM_ALLOC_ENABLE="0")
    assert out == ["True", "''", "'0'"]
