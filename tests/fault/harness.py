"""A cluster of separate processes that fault tests can kill, stop and restart one by one.

Unlike ``collectives-server local``, the coordinator and each worker are direct
children of the test, so the coordinator can be restarted on the same port and a
worker can be replaced. Every wait is a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Sequence

import torch
from helpers import wait_until
from launcher import Daemon, free_port, spawn

import collectives

HEARTBEAT_S = 0.2
LEASE_S = 1.5
OP_TIMEOUT_S = 4.0
RESULTS: list[dict] = []  # one row per fault, printed by conftest at the end
SOAK_LINES: list[str] = []  # the soak's summary, printed by conftest at the end


def checksum(t: torch.Tensor) -> str:
    data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(data).hexdigest()


# Every daemon the fault harness started, for the session's check that none
# logged INTERNAL and for a failed test's log tails.
FAULT_DAEMONS: list[Daemon] = []


def spawn_daemon(name: str, args: list[str], timeout_s: float = 60.0) -> Daemon:
    """``collectives-server ARGS`` started by the tests' launcher, logging at INFO: a
    failed test's log tail then says when a daemon joined, left or was told to stop."""
    daemon = spawn(name, [*args, "--log-level", "INFO"], timeout_s=timeout_s)
    FAULT_DAEMONS.append(daemon)
    return daemon


class ClusterViews:
    """What every process cluster of the fault tests offers: members, readiness, daemons."""

    client: collectives.Cluster
    workers: list[Daemon]

    def members(self) -> list:
        return sorted((w for w in self.client.workers() if w.rank >= 0), key=lambda w: w.rank)

    def wait_ready(self, size: int, after_generation: int = 0, timeout_s: float = 30.0) -> list:
        def ready():
            members = self.members()
            return (
                self.client.generation > after_generation
                and len(members) == size
                and all(w.state == "ready" for w in members)
                and members
            )

        return wait_until(ready, timeout_s, f"{size} ready workers after gen {after_generation}")

    def daemon_at(self, address: str) -> Daemon:
        return next(d for d in self.workers if d.address == address)


def timing_flags(lease_s: float = LEASE_S, op_timeout_s: float = OP_TIMEOUT_S) -> tuple[str, ...]:
    """The timing flags a coordinator of the fault tests runs with."""
    return (
        "--heartbeat",
        str(HEARTBEAT_S),
        "--lease",
        str(lease_s),
        "--op-timeout-s",
        str(op_timeout_s),
    )


# What every coordinator of the fault tests runs with, unless a test needs its
# stopped workers kept for longer than a lease (timing_flags).
TIMING_FLAGS = timing_flags()


class FaultCluster(ClusterViews):
    def __init__(
        self,
        workers: int,
        min_workers: int,
        max_workers: int | None = None,
        worker_args: tuple[str, ...] = (),
        lease_s: float = LEASE_S,
        each_worker_args: Sequence[Sequence[str]] = (),
        op_timeout_s: float = OP_TIMEOUT_S,
    ) -> None:
        """``worker_args`` go to every worker; ``each_worker_args[i]``, if given,
        to the i-th of the first ``workers`` too."""
        self.port = free_port()
        self.lease_s = lease_s
        self.op_timeout_s = op_timeout_s
        self.worker_args = worker_args
        self.min_workers = min_workers
        self.max_workers = max_workers or workers
        self.coordinator = self.start_coordinator()
        own = [*each_worker_args, *[()] * workers][:workers]
        self.workers = [self.start_worker(*extra) for extra in own]
        self.client = collectives.connect(self.coordinator.address, timeout=60)
        self.wait_ready(workers)

    def start_coordinator(self) -> Daemon:
        return spawn_daemon(
            "coordinator",
            [
                "coordinator",
                "--port",
                str(self.port),
                "--min-workers",
                str(self.min_workers),
                "--max-workers",
                str(self.max_workers),
                *timing_flags(self.lease_s, self.op_timeout_s),
            ],
        )

    def start_worker(self, *extra: str) -> Daemon:
        argv = ["worker", "--coordinator", f"127.0.0.1:{self.port}", *self.worker_args, *extra]
        return spawn_daemon("worker", argv)

    def close(self) -> None:
        self.client.close()
        for d in [*self.workers, self.coordinator]:
            d.stop()


def record(fault: str, detect_s: float, recover_s: float, note: str = "") -> None:
    """One row of the table the fault suite's conftest prints at the end of the run."""
    RESULTS.append({"fault": fault, "detect_s": detect_s, "recover_s": recover_s, "note": note})


def put_checksummed(cluster: FaultCluster, name: str, gen: torch.Generator) -> dict[str, str]:
    """A distinct tensor on every member; returns address -> checksum."""
    sums = {}
    for w in cluster.members():
        t = torch.randn(1000, generator=gen)
        cluster.client.put(name, t, rank=w.rank)
        sums[w.address] = checksum(t)
    return sums


class TcpProxy:
    """Forwards a port to a worker's real port; ``cut()`` makes it unreachable, ``restore()`` not.

    Cutting closes the listening socket and every forwarded connection, as a
    firewall rule or a broken link would, while the worker process lives on.
    """

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.listen_port = listen_port
        self.target_port = target_port
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._server: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.listen_port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, []
        if server is not None:
            # close() alone does not wake a thread blocked in accept(); shutdown() does.
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
