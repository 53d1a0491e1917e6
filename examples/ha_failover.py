"""A highly available control plane on one machine: etcd, 3 coordinators, 2 workers.

Starts a real etcd (Debian: ``apt-get install etcd-server``) on free loopback
ports with a temporary data directory, three ``collectives-server coordinator
--store etcd://...`` that elect one leader, and two workers given all three
coordinator addresses. A client all-reduces random tensors (each result checked
against torch) while the leading coordinator is killed with SIGKILL; a standby
takes over and the ops never stop. Everything is stopped at the end.

    .venv/bin/python examples/ha_failover.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import torch

import collectives
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:
            value = None
        if value:
            return value
        time.sleep(0.05)  # polling a condition with a deadline
    raise SystemExit(f"timed out after {timeout_s} s waiting for {what}")


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    """A collectives-server daemon; returns it and the address it prints first."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "collectives_server", *args, "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(60)
    if not line or not line[0].strip():
        proc.kill()
        raise SystemExit(f"{args[0]} did not start")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, line[0].strip()


def leader_of(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return stub.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=2).leader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="ops after the failover")
    args = parser.parse_args()
    etcd_bin = shutil.which("etcd")
    if etcd_bin is None:
        raise SystemExit("etcd is not installed: apt-get install etcd-server")
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        client_url = f"http://127.0.0.1:{free_port()}"
        peer_url = f"http://127.0.0.1:{free_port()}"
        procs.append(
            subprocess.Popen(
                [
                    etcd_bin,
                    f"--data-dir={Path(tmp) / 'etcd'}",
                    f"--listen-client-urls={client_url}",
                    f"--advertise-client-urls={client_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=default={peer_url}",
                    "--logger=zap",
                    "--log-level=error",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        try:
            wait_for(
                "etcd",
                lambda: (
                    json.load(urllib.request.urlopen(f"{client_url}/health", timeout=1))["health"]
                    == "true"
                ),
                30,
            )
            store = "etcd://" + client_url.removeprefix("http://")
            coordinators = []
            for _ in range(3):
                proc, address = start(
                    ["coordinator", "--world-size", "2", "--store", store, "--leader-ttl-s", "2"]
                )
                procs.append(proc)
                coordinators.append((proc, address))
            addresses = ",".join(address for _, address in coordinators)
            for _ in range(2):
                procs.append(start(["worker", "--coordinator", addresses])[0])
            cluster = collectives.connect(addresses, timeout=60)
            leader = wait_for("a leader", lambda: leader_of(addresses.split(",")[0]), 15)
            print(f"coordinators {addresses}; leader {leader}; {cluster.world_size} workers")

            def one_op() -> None:
                parts = [torch.randn(1000) for _ in range(cluster.world_size)]
                for rank, part in enumerate(parts):
                    cluster.put("x", part, rank=rank)
                cluster.all_reduce("x")
                torch.testing.assert_close(cluster.get("x", rank=0), sum(parts))

            for _ in range(20):
                one_op()
            victim = next(proc for proc, address in coordinators if address == leader)
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            print(f"killed the leading coordinator {leader} (SIGKILL)")
            standbys = [a for p, a in coordinators if p is not victim]
            ops = 0
            new_leader = ""
            while time.monotonic() - killed_at < args.seconds or not new_leader:
                one_op()
                ops += 1
                if not new_leader:
                    named = leader_of(standbys[0])
                    if named and named != leader:
                        new_leader = named
                        print(f"{named} leads after {time.monotonic() - killed_at:.2f} s")
                if time.monotonic() - killed_at > 30:
                    raise SystemExit("no standby took over within 30 s")
            print(f"{ops} all_reduces during and after the failover, every result equal to torch's")
            cluster.close()
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
