"""A cluster of separate processes that fault tests can kill, stop and restart one by one.

Unlike ``collectives-server local``, the coordinator and each worker are direct
children of the test, so the coordinator can be restarted on the same port and a
worker can be replaced. Every wait is a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from helpers import free_port, wait_until

import collectives

HEARTBEAT_S = 0.2
LEASE_S = 1.5
OP_TIMEOUT_S = 4.0
RESULTS: list[dict] = []  # one row per fault, printed by conftest at the end
SOAK_LINES: list[str] = []  # the soak's summary, printed by conftest at the end


def checksum(t: torch.Tensor) -> str:
    data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(data).hexdigest()


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen
    address: str
    _drain: threading.Thread = field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with_cont = [signal.SIGCONT, signal.SIGTERM]
            for sig in with_cont:
                self.signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# Every daemon's log (its stderr), for the session's check that none logged INTERNAL.
DAEMON_LOGS: list[Path] = []


class DaemonExited(AssertionError):
    """A daemon ended before printing its address (its log's last lines say why)."""


def _spawn(name: str, args: list[str], timeout_s: float = 60.0) -> Daemon:
    fd, log_name = tempfile.mkstemp(prefix=f"fault-{name}-", suffix=".log")
    DAEMON_LOGS.append(Path(log_name))
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "collectives_server", *args, "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
    first: list[str] = []
    reader = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not first or not first[0].strip():
        proc.kill()
        code = proc.wait(10)
        tail = "\n".join(Path(log_name).read_text(errors="replace").splitlines()[-5:])
        if first:  # its standard output ended: it exited on its own
            raise DaemonExited(
                f"{name} exited with code {code} before printing its address:\n{tail}"
            )
        raise AssertionError(f"{name} did not print its address within {timeout_s} s:\n{tail}")
    drain = threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True)
    drain.start()
    return Daemon(name, proc, first[0].strip(), drain)


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


# The timing flags every coordinator of the fault tests runs with.
TIMING_FLAGS = (
    "--heartbeat",
    str(HEARTBEAT_S),
    "--lease",
    str(LEASE_S),
    "--op-timeout-s",
    str(OP_TIMEOUT_S),
)


class FaultCluster(ClusterViews):
    def __init__(
        self,
        workers: int,
        min_workers: int,
        max_workers: int | None = None,
        worker_args: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.worker_args = worker_args
        self.min_workers = min_workers
        self.max_workers = max_workers or workers
        self.coordinator = self.start_coordinator()
        self.workers = [self.start_worker() for _ in range(workers)]
        self.client = collectives.connect(self.coordinator.address, timeout=60)
        self.wait_ready(workers)

    def start_coordinator(self) -> Daemon:
        return _spawn(
            "coordinator",
            [
                "coordinator",
                "--port",
                str(self.port),
                "--min-workers",
                str(self.min_workers),
                "--max-workers",
                str(self.max_workers),
                *TIMING_FLAGS,
            ],
        )

    def start_worker(self, *extra: str) -> Daemon:
        argv = ["worker", "--coordinator", f"127.0.0.1:{self.port}", *self.worker_args, *extra]
        return _spawn("worker", argv)

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
