"""A coordinator and N workers as child processes on one machine: the embedded default.

``collectives-server local`` (and tests, in-process) use :class:`LocalCluster` to run
the very binaries that production runs one per host, as children of one supervisor:

* the coordinator starts first; its first stdout line is its address, which the
  workers are pointed at. :meth:`LocalCluster.start` returns once the coordinator
  listens; the workers register in the background (:meth:`LocalCluster.wait_ready`
  waits for a sealed, joined generation);
* each child's later stdout is drained by a thread into the log (a full pipe must
  never block a daemon), and its stderr is inherited;
* a worker dying is logged (with its address and rank), not fatal: the coordinator
  re-forms the cluster without it, and with ``max_restarts`` the worker's slot is
  started again (same flags, same metrics port), as torchrun restarts a failed
  worker; the new process rejoins as a newcomer and the cluster re-forms at full
  size. Each slot is restarted at most ``max_restarts`` times;
* the coordinator and the workers are forked from one interpreter that imported
  them once (:mod:`preloaded_workers`), so starting or restarting one costs a fork,
  not a fresh import of torch; ``preload=False`` (or another ``python``) starts each
  as ``python -m collectives_server coordinator`` / ``worker``;
* :meth:`LocalCluster.stop` sends SIGINT to the workers (stop now: SIGTERM would
  make each member drain itself onto a spare first), then SIGTERM to the
  coordinator, waits within one deadline and SIGKILLs what is left;
* a worker that exits 0 by itself was drained: its slot starts again as a spare.

Every wait here is an ``Event``/process wait with a deadline; nothing sleeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from collectives_server.cli.common import PARENT_PID_ENV
from collectives_server.coordinator.daemon import CoordinatorConfig
from collectives_server.preloaded_workers import (
    ZYGOTE_ENV,
    PreloadedProcess,
    PreloadedWorkers,
    available,
)
from collectives_server.settings import to_argv
from collectives_server.worker.config import WorkerConfig

__all__ = ["Child", "LocalCluster", "assign_devices"]

log = logging.getLogger(__name__)

# How long a child whose stdout closed is given to exit before it is described.
_EXIT_REPORT_S = 5.0


@dataclass
class Child:
    """One supervised child process and what it printed first (its address)."""

    name: str
    process: subprocess.Popen[bytes] | PreloadedProcess
    address: str | None = None
    returncode: int | None = None
    first_line: threading.Event = field(default_factory=threading.Event)
    exited: threading.Event = field(default_factory=threading.Event)
    # The worker's launch slot (its --metrics-port offset); None for the coordinator.
    slot: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def describe_exit(self) -> str:
        code = self.returncode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"


def assign_devices(workers: int, spec: str, cuda_count: Callable[[], int]) -> list[tuple[str, ...]]:
    """Which devices each local worker gets, from ``--devices``.

    ``cpu``: every worker on CPU. A comma list (``cuda:0,cuda:1,...``): split into
    ``workers`` contiguous, non-empty parts. ``auto``: split the visible CUDA devices
    the same way if there are at least ``workers`` of them (NCCL needs one GPU per
    rank), else CPU. Raises ``ValueError`` for an impossible list.
    """
    spec = spec.strip()
    if spec == "cpu":
        return [("cpu",)] * workers
    if spec == "auto":
        count = cuda_count()
        if count < workers:
            if count:
                log.warning(
                    "%d CUDA devices for %d workers: NCCL needs one GPU per rank, using cpu",
                    count,
                    workers,
                )
            return [("cpu",)] * workers
        devices = [f"cuda:{i}" for i in range(count)]
    else:
        devices = [d.strip() for d in spec.split(",") if d.strip()]
        if len(devices) < workers:
            raise ValueError(
                f"--devices lists {len(devices)} devices for {workers} workers; "
                "give at least one per worker, or 'cpu', or 'auto'"
            )
    return [
        tuple(devices[i * len(devices) // workers : (i + 1) * len(devices) // workers])
        for i in range(workers)
    ]


def _cuda_count() -> int:
    # Skip the slow torch import on machines without an NVIDIA driver.
    if not os.path.exists("/dev/nvidiactl") or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    import torch

    return torch.cuda.device_count()


class LocalCluster:
    """Supervises ``python -m collectives_server coordinator`` and N ``worker`` children.

    ``on_exit(child)`` is called (from a watcher thread) when a child exits on its own.
    ``die_with_parent`` makes children SIGTERM themselves if this process dies (Linux;
    only for a process that stays alive on the main thread, as the CLI does: the
    kernel ties it to the thread that started the child).
    ``coordinator_config`` and ``worker_config`` are what the coordinator and every
    worker are started with (default: their dataclasses' defaults); the cluster's
    size, each worker's address, devices and the metrics ports are set here
    (:meth:`coordinator_config`, :meth:`worker_config`). The coordinator's watch-stream
    caps are raised by ``workers``: each worker holds one, and the caps bound what
    clients can open beside them. ``coordinator_args``/``worker_args`` are
    appended to those children's command lines (the CLI passes the TLS and
    token flags this way: paths, never secrets).
    ``worker_token_file`` is the worker token of the coordinator's worker-only RPCs
    (``--worker-token-file``); None writes a fresh random one (mode 0600) at start,
    given to the coordinator and every worker, and removed at stop.
    """

    def __init__(
        self,
        workers: int,
        *,
        min_workers: int | None = None,
        coordinator_config: CoordinatorConfig | None = None,
        worker_config: WorkerConfig | None = None,
        devices: str = "auto",
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        log_level: str = "INFO",
        log_format: str = "text",
        worker_args: Sequence[str] = (),
        coordinator_args: Sequence[str] = (),
        client_security: Any = None,
        worker_token_file: str | None = None,
        start_timeout_s: float = 60.0,
        die_with_parent: bool = False,
        on_exit: Callable[[Child], None] | None = None,
        python: str = sys.executable,
        max_restarts: int = 0,
        preload: bool = True,
        spares: int = 0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        min_workers = workers if min_workers is None else min_workers
        if not 1 <= min_workers <= workers:
            raise ValueError(f"min_workers must be in 1..{workers}, got {min_workers}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.workers = workers
        self.min_workers = min_workers
        # Live workers beyond the generation's size: each takes a member's place at once.
        self.spares = spares
        self._common = ["--log-level", log_level, "--log-format", log_format]
        self._coordinator_template = coordinator_config or CoordinatorConfig(
            min_workers=min_workers, max_workers=workers
        )
        self._worker_config = worker_config or WorkerConfig(coordinator="")
        self._devices: list[tuple[str, ...]] | None = None
        # --metrics-port P: the coordinator serves on P, worker i on P+1+i (0: any free port).
        self._metrics_port = metrics_port
        self._metrics_host = metrics_host
        self._coordinator_args = list(coordinator_args)
        # collectives.wire.security.ChannelSecurity for wait_ready (None: plaintext, no token).
        self._client_security = client_security
        self._devices_spec = devices
        self._worker_args = list(worker_args)
        # The worker token of this cluster's own workers: the given file, else a fresh
        # one written at start (mode 0600) and removed at stop.
        self._worker_token_file = worker_token_file
        self._owned_token_file: str | None = None
        self._start_timeout_s = start_timeout_s
        self._die_with_parent = die_with_parent
        self._on_exit = on_exit
        self._python = python
        self._preloaded = None
        if preload and available(python):
            shared = os.environ.get(ZYGOTE_ENV) or None  # another launcher's zygote
            self._preloaded = PreloadedWorkers(python, connect=shared)
        self._stopping = False
        # Serialises restarts against stop(): no worker is started once stopping.
        self._lock = threading.Lock()
        self.max_restarts = max_restarts
        # Per launch slot: the worker's command line and how often it was restarted.
        self._slot_args: list[list[str]] = []
        self.restarts: list[int] = []
        self.coordinator: Child | None = None
        self.worker_children: list[Child] = []

    # ---- lifecycle -------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Starts the coordinator, waits for its address, then starts the workers.

        Raises ``RuntimeError`` (after stopping whatever started) if the coordinator
        does not print its address within ``start_timeout_s``.
        """
        if self.coordinator is not None:
            raise RuntimeError("local cluster already started")
        self._devices = assign_devices(self.processes, self._devices_spec, _cuda_count)
        token_file = self._worker_token_file or self._write_worker_token()
        token_flag = f"--worker-token-file={token_file}"
        self.coordinator = self._spawn(
            "coordinator",
            [
                "coordinator",
                f"--min-workers={self.min_workers}",
                f"--max-workers={self.workers}",
                *to_argv(self.coordinator_config(), passed_on=None),
                *self._coordinator_args,
                token_flag,
                *self._common,
            ],
            preloaded=True,  # the zygote the workers need anyway: one import for all
        )
        child = self.coordinator
        printed = child.first_line.wait(self._start_timeout_s)
        if not printed or not child.address:
            if printed:
                # Its stdout closed without an address: it is exiting; say how.
                child.exited.wait(_EXIT_REPORT_S)
            state = child.describe_exit() if child.exited.is_set() else "still running"
            self.stop()
            when = (
                "before printing its address"
                if printed
                else (f"without printing its address within {self._start_timeout_s:g} s")
            )
            raise RuntimeError(f"the coordinator {state} {when}; see its log above")
        log.info("coordinator %s (pid %d)", child.address, child.pid)
        try:
            for i in range(self.processes):
                config = self.worker_config(i, child.address)
                args = ["worker", *to_argv(config, passed_on=None), *self._common]
                self._slot_args.append([*args, *self._worker_args, token_flag])
                self.restarts.append(0)
                self.worker_children.append(self._spawn_worker(i))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT the workers (the whole cluster stops: none drains itself onto a spare,
        as SIGTERM would make it), then SIGTERM the coordinator; SIGKILL what outlives
        ``timeout_s``."""
        with self._lock:
            self._stopping = True
        began = time.monotonic()
        deadline = began + timeout_s
        stops = ((self.worker_children, signal.SIGINT),)
        if self.coordinator:
            stops += (([self.coordinator], signal.SIGTERM),)
        for group, sig in stops:
            for child in group:
                if not child.exited.is_set():
                    _signal(child, sig)
            for child in group:
                child.exited.wait(max(0.0, deadline - time.monotonic()))
        for child in self._children():
            if not child.exited.is_set():
                log.warning("%s (pid %d) ignored SIGTERM; killing it", child.name, child.pid)
                _signal(child, signal.SIGKILL)
                child.exited.wait(5.0)
        stopped = time.monotonic()
        if self._preloaded is not None:
            self._preloaded.close()
        if self._owned_token_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._owned_token_file)
            self._owned_token_file = None
        log.info(
            "stopped in %.2f s (the processes %.2f s, the zygote %.2f s)",
            time.monotonic() - began,
            stopped - began,
            time.monotonic() - stopped,
        )

    def _write_worker_token(self) -> str:
        """A fresh worker token in a new file only this user can read; returns its path."""
        fd, path = tempfile.mkstemp(prefix="collectives-worker-token-")  # mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        self._owned_token_file = path
        return path

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def coordinator_config(self) -> CoordinatorConfig:
        """The config the coordinator is started with: the cluster's
        ``coordinator_config`` with this cluster's size, metrics port and watch caps."""
        limits = self._coordinator_template.limits
        return dataclasses.replace(
            self._coordinator_template,
            min_workers=self.min_workers,
            max_workers=self.workers,
            metrics_port=self._metrics_port_of(0),
            metrics_host=self._metrics_host,
            limits=dataclasses.replace(
                limits,
                max_watch_streams=limits.max_watch_streams + self.processes,
                max_watch_streams_per_peer=limits.max_watch_streams_per_peer + self.processes,
            ),
        )

    def _metrics_port_of(self, offset: int) -> int | None:
        """The coordinator's (offset 0) or worker ``offset - 1``'s metrics port."""
        if self._metrics_port is None:
            return None
        return self._metrics_port + offset if self._metrics_port else 0

    def worker_config(self, slot: int, coordinator: str = "") -> WorkerConfig:
        """The config worker ``slot`` is started with: the cluster's ``worker_config``
        with the coordinator at ``coordinator``, the coordinator's host, and the slot's
        devices and metrics port (``metrics_port`` + 1 + ``slot``)."""
        if self._devices is None:
            self._devices = assign_devices(self.processes, self._devices_spec, _cuda_count)
        return dataclasses.replace(
            self._worker_config,
            coordinator=coordinator,
            host=self._coordinator_template.host,
            port=0,
            devices=self._devices[slot],
            metrics_port=self._metrics_port_of(1 + slot),
            metrics_host=self._metrics_host,
        )

    # ---- state -----------------------------------------------------------------

    @property
    def processes(self) -> int:
        """Worker processes started: the members (``workers``) and the spares."""
        return self.workers + self.spares

    @property
    def address(self) -> str:
        """The coordinator's ``host:port``."""
        if self.coordinator is None or not self.coordinator.address:
            raise RuntimeError("local cluster not started")
        return self.coordinator.address

    @property
    def coordinator_process(self) -> subprocess.Popen[bytes] | PreloadedProcess | None:
        return self.coordinator.process if self.coordinator else None

    @property
    def worker_processes(self) -> list[subprocess.Popen[bytes] | PreloadedProcess]:
        return [c.process for c in self.worker_children]

    def worker_addresses(self, timeout_s: float = 60.0) -> list[str]:
        """Each worker's address (in start order), waiting for it to be printed."""
        deadline = time.monotonic() + timeout_s
        for child in self.worker_children:
            if not child.first_line.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{child.name} printed no address within {timeout_s:g} s")
        return [c.address or "" for c in self.worker_children]

    def wait_ready(self, timeout_s: float = 60.0, world_size: int | None = None) -> Any:
        """Waits for a formed, fully joined generation of ``world_size`` (default: all).

        Returns the ``collectives.v1.Cluster`` message. Raises ``TimeoutError``.
        """
        import grpc

        from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
        from collectives.wire.security import PLAINTEXT

        want = self.workers if world_size is None else world_size
        last = None
        security = self._client_security or PLAINTEXT
        with security.open_channel(self.address, []) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            stream = stub.WatchCluster(coordinator_pb2.WatchClusterRequest(), timeout=timeout_s)
            try:
                for last in stream:
                    if last.formed and last.ready and last.world_size == want:
                        return last
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            finally:
                stream.cancel()
        status = last.status if last is not None else "no answer from the coordinator"
        raise TimeoutError(f"cluster of {want} not ready within {timeout_s:g} s: {status}")

    # ---- children --------------------------------------------------------------

    def _children(self) -> list[Child]:
        return [*self.worker_children, *([self.coordinator] if self.coordinator else [])]

    def _spawn(
        self, name: str, args: list[str], threads: int | None = None, preloaded: bool = False
    ) -> Child:
        env = dict(os.environ)
        if threads is not None:
            # Like torchrun: workers sharing a host share its cores, unless the user
            # chose (OMP_NUM_THREADS set). Oversubscribed OpenMP threads spin-wait
            # against each other and against gloo's threads.
            env.setdefault("OMP_NUM_THREADS", str(threads))
        if self._die_with_parent:
            env[PARENT_PID_ENV] = str(os.getpid())
        process: subprocess.Popen[bytes] | PreloadedProcess
        if preloaded and self._preloaded is not None:
            process = self._preloaded.start(args, env, name)
        else:
            process = subprocess.Popen(
                [self._python, "-m", "collectives_server", *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=None,  # passes through to ours
                env=env,
            )
        child = Child(name=name, process=process)
        tag = name.replace(" ", "-")
        threading.Thread(target=self._read, args=(child,), name=f"{tag}-out", daemon=True).start()
        threading.Thread(target=self._reap, args=(child,), name=f"{tag}-wait", daemon=True).start()
        log.debug("started %s (pid %d): %s", name, process.pid, " ".join(args))
        return child

    def _read(self, child: Child) -> None:
        stream = child.process.stdout
        assert stream is not None
        with stream:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip()
                if not child.first_line.is_set():
                    child.address = line or None
                    child.first_line.set()
                elif line:
                    log.info("%s stdout: %s", child.name, line)
        child.first_line.set()  # EOF before any line: wake whoever waits for it

    def _spawn_worker(self, slot: int) -> Child:
        child = self._spawn(
            f"worker {slot}",
            self._slot_args[slot],
            threads=_threads_per_worker(self.workers),
            preloaded=True,
        )
        child.slot = slot
        return child

    def _reap(self, child: Child) -> None:
        child.returncode = child.process.wait()
        child.exited.set()
        if self._stopping:
            log.debug("%s (pid %d) %s", child.name, child.pid, child.describe_exit())
            return
        if child is self.coordinator:
            log.error("coordinator (pid %d) %s", child.pid, child.describe_exit())
        else:
            # Exit 0 by itself: drained (its rank handed over); anything else: died.
            log.log(
                logging.INFO if child.returncode == 0 else logging.WARNING,
                "worker at %s (%s, pid %d) %s",
                child.address or "(no address yet)",
                self._rank_of(child.address),
                child.pid,
                child.describe_exit(),
            )
            self._restart(child)
        if self._on_exit is not None:
            self._on_exit(child)

    def _restart(self, child: Child) -> None:
        """Starts a dead worker's slot again, at most ``max_restarts`` times (as torchrun).

        A worker that exited 0 by itself was drained (its rank handed over, see
        ``docs/deploying.md``): its slot is started again every time, uncounted, and
        the new process registers as a spare."""
        slot = child.slot
        if slot is None:
            return
        with self._lock:
            if self._stopping:
                return
            if child.returncode == 0:
                replacement = self._spawn_worker(slot)
                self.worker_children[slot] = replacement
                log.info(
                    "worker slot %d was drained; restarted it as a spare (pid %d)",
                    slot,
                    replacement.pid,
                )
                return
            if self.restarts[slot] >= self.max_restarts:
                if self.max_restarts:
                    log.error(
                        "worker slot %d died %d times; not restarting it (--max-restarts %d)",
                        slot,
                        self.restarts[slot] + 1,
                        self.max_restarts,
                    )
                return
            self.restarts[slot] += 1
            replacement = self._spawn_worker(slot)
            self.worker_children[slot] = replacement
        log.warning(
            "restarted worker slot %d (restart %d of %d, pid %d); it rejoins as a new member",
            slot,
            self.restarts[slot],
            self.max_restarts,
            replacement.pid,
        )

    def _rank_of(self, address: str | None) -> str:
        """'rank R of generation G' for a worker address, asked of the coordinator (1 s)."""
        if not address or self.coordinator is None or not self.coordinator.address:
            return "rank unknown"
        import grpc

        from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
        from collectives.wire.security import PLAINTEXT

        try:
            security = self._client_security or PLAINTEXT
            with security.open_channel(self.coordinator.address, []) as channel:
                cluster = coordinator_pb2_grpc.CoordinatorStub(channel).GetCluster(
                    coordinator_pb2.GetClusterRequest(), timeout=1.0
                )
        except (grpc.RpcError, OSError, ValueError):
            return "rank unknown"
        for worker in cluster.workers:
            if worker.address == address and worker.rank >= 0:
                return f"rank {worker.rank} of generation {cluster.generation}"
        return f"not a member of generation {cluster.generation}"


def _signal(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        child.process.send_signal(sig)


def _threads_per_worker(workers: int) -> int:
    """Intra-op threads for each of ``workers`` workers on this host: an equal share."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))
