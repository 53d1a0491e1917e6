"""An HA cluster of real processes: a real etcd, 3 coordinators electing a leader on it,
workers and clients given every coordinator's address.

Each coordinator reaches etcd through its own :class:`~harness.TcpProxy`, so a test
can cut one coordinator off from etcd (a partition) while the rest of the system
still reaches both. Every wait is a condition with a deadline.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path

import grpc
from etcd_server import EtcdServer
from harness import TIMING_FLAGS, ClusterViews, TcpProxy, spawn_daemon
from helpers import wait_until
from launcher import Daemon, free_port

import collectives
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc

LEADER_TTL_S = 2
# A standby campaigns every poll (<= 0.25 s) and its leader's key lives one TTL
# after the last renewal: a new leader within TTL + poll + the first write.
TAKEOVER_BOUND_S = LEADER_TTL_S + 2.0


def cluster_of(address: str, timeout_s: float = 3.0) -> coordinator_pb2.Cluster:
    """One GetCluster from the coordinator at ``address``."""
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return stub.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=timeout_s)


def stored_state(etcd: EtcdServer, cluster_name: str) -> dict:
    """The membership document in etcd, read through etcd's own JSON gateway."""
    key = base64.b64encode(f"/collectives/{cluster_name}/state".encode()).decode()
    request = urllib.request.Request(
        f"http://{etcd.endpoint}/v3/kv/range",
        data=json.dumps({"key": key}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        kvs = json.loads(reply.read()).get("kvs") or []
    assert kvs, "no membership document in etcd"
    return json.loads(base64.b64decode(kvs[0]["value"]))


class HaCluster(ClusterViews):
    def __init__(
        self,
        tmp: Path,
        workers: int = 3,
        min_workers: int = 2,
        coordinators: int = 3,
        leader_ttl_s: int = LEADER_TTL_S,
    ) -> None:
        self.etcd = EtcdServer(tmp / "etcd")
        self.leader_ttl_s = leader_ttl_s
        self.name = f"ha-{free_port()}"
        self.min_workers = min_workers
        self.max_workers = workers
        self.ports = [free_port() for _ in range(coordinators)]
        self.addresses = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.proxies = [TcpProxy(free_port(), self.etcd.client_port) for _ in self.ports]
        self.coordinators: list[Daemon | None] = [None] * coordinators
        self.workers: list[Daemon] = []
        self.client: collectives.Cluster | None = None
        try:
            for i in range(coordinators):
                self.start_coordinator(i)
            self.wait_for_leader()
            self.workers = [self.start_worker() for _ in range(workers)]
            self.client = collectives.connect(self.addresses, timeout=60)
            self.wait_ready(workers)
        except BaseException:
            self.close()
            raise

    # ---- processes -----------------------------------------------------------------

    def start_coordinator(self, i: int) -> Daemon:
        daemon = spawn_daemon(
            f"coordinator-{i}",
            [
                "coordinator",
                "--port",
                str(self.ports[i]),
                "--store",
                f"etcd://127.0.0.1:{self.proxies[i].listen_port}",
                "--cluster-name",
                self.name,
                "--leader-ttl-s",
                str(self.leader_ttl_s),
                "--min-workers",
                str(self.min_workers),
                "--max-workers",
                str(self.max_workers),
                *TIMING_FLAGS,
            ],
        )
        self.coordinators[i] = daemon
        return daemon

    def start_worker(self) -> Daemon:
        return spawn_daemon("worker", ["worker", "--coordinator", self.addresses])

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for d in [*self.workers, *self.coordinators]:
            if d is not None:
                d.stop()
        for proxy in self.proxies:
            proxy.cut()
        self.etcd.stop()

    def address(self, i: int) -> str:
        """The gRPC address of coordinator ``i``."""
        return f"127.0.0.1:{self.ports[i]}"

    # ---- views -----------------------------------------------------------------------

    def live_coordinators(self) -> list[int]:
        return [i for i, d in enumerate(self.coordinators) if d and d.proc.poll() is None]

    def leaders(self) -> set[str]:
        """The leader each live coordinator names (a set of one when they agree)."""
        named = set()
        for i in self.live_coordinators():
            try:
                named.add(cluster_of(f"127.0.0.1:{self.ports[i]}").leader)
            except grpc.RpcError:
                named.add("?")
        return named

    def leader(self) -> int | None:
        """Index of the coordinator every live one names as leader, if they agree."""
        named = self.leaders()
        if len(named) != 1:
            return None
        (address,) = named
        for i in self.live_coordinators():
            if address == f"127.0.0.1:{self.ports[i]}":
                return i
        return None

    def wait_for_leader(self, timeout_s: float = 15.0, other_than: int | None = None) -> int:
        """Index of the coordinator all live ones name as leader, once they agree."""

        def agreed() -> tuple[int] | None:
            i = self.leader()
            return (i,) if i is not None and i != other_than else None

        return wait_until(agreed, timeout_s, f"a coordinator other than {other_than} to lead")[0]
