"""The one way the tests start daemons and pick ports.

Every daemon a test starts (a coordinator, a worker, a ``local`` launcher with
its children) is a :class:`Daemon`: ``python -m collectives_server ARGS`` in a
process group of its own (forked from this test process's preloaded zygote, as
``local`` forks its coordinator and workers: :mod:`preloaded_workers`, ended by
:func:`close_zygote` at the session's end), its standard error in a log under the session's
temporary directory, its first line of standard output (its address) read
with a deadline and the rest drained. :class:`LocalCluster` is the ``local``
launcher as a daemon. The fault harness, the formation stress test and the
cluster fixtures all start their processes here, so one place knows every
process this test process made: :func:`started` lists them (for log checks and
tails). Each inherits the run's id from the environment (tests/leftovers.py),
by which the run's last check finds a straggler even after its parent died,
and the run's ``TMPDIR``, where its scratch files go.

Ports: :func:`free_port_block` picks ports below the kernel's ephemeral range,
from a slice of that range that belongs to this test process alone, so two
pytest-xdist workers never hand the same port to two daemons.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from signal import SIGCONT, SIGKILL, SIGSTOP, SIGTERM

from collectives_server.preloaded_workers import (
    ZYGOTE_ENV,
    PreloadedProcess,
    PreloadedWorkers,
    available,
)

__all__ = [
    "close_zygote",
    "Daemon",
    "DaemonExited",
    "LocalCluster",
    "free_port",
    "free_port_block",
    "launch",
    "listening_pid",
    "log_dir",
    "server_argv",
    "set_log_dir",
    "share_zygote",
    "spawn",
    "started",
    "stop_process",
]

_ADDRESS_RE = re.compile(r"((?:\[[0-9A-Fa-f:]+\]|[A-Za-z0-9_.-]+):\d{1,5})")
_STARTED: list[Daemon] = []
_LOG_DIR: list[Path] = []


def set_log_dir(directory: Path) -> None:
    """Where daemon logs go for the rest of this process (the session's temp dir)."""
    directory.mkdir(parents=True, exist_ok=True)
    _LOG_DIR[:] = [directory]


def log_dir() -> Path:
    """The daemon log directory: the session's, or a fresh one for a script run."""
    if not _LOG_DIR:
        set_log_dir(Path(tempfile.mkdtemp(prefix="collectives-daemons-")))
    return _LOG_DIR[0]


def started() -> list[Daemon]:
    """Every daemon this process started, in order (for log checks and tails)."""
    return list(_STARTED)


class DaemonExited(AssertionError):
    """A daemon ended before printing its address (its log's last lines say why)."""


def server_argv(*args: str) -> list[str]:
    """The command line of ``collectives-server ARGS`` run by this Python."""
    return [sys.executable, "-m", "collectives_server", *args]


_ZYGOTE: list[tuple[PreloadedWorkers, str]] = []


def _zygote() -> PreloadedWorkers:
    """This process's worker zygote (started with its first worker). It listens on a
    Unix socket, so the ``local`` launchers this process starts fork from it too."""
    if not _ZYGOTE:
        path = Path(tempfile.gettempdir()) / f"zygote-{os.getpid()}.sock"
        _ZYGOTE.append((PreloadedWorkers(listen=str(path)), str(path)))
    return _ZYGOTE[0][0]


def share_zygote() -> str:
    """Starts this process's worker zygote now and returns where it listens, for the
    :data:`ZYGOTE_ENV` of a ``local`` launcher: one import of torch per test process
    instead of one per cluster. :class:`LocalCluster` hands the path to its launcher
    explicitly (no test that saves and restores ``os.environ`` can take it away); it
    is also left in this process's environment, for the launchers a test runs as a
    user would (README blocks, examples)."""
    _zygote().ensure_started()
    path = _ZYGOTE[0][1]
    os.environ[ZYGOTE_ENV] = path
    return path


def close_zygote() -> None:
    """Ends this process's worker zygote, if it started one (its workers are stopped)."""
    os.environ.pop(ZYGOTE_ENV, None)
    while _ZYGOTE:
        _ZYGOTE.pop()[0].close()


# COLLECTIVES_TEST_FORK_WORKERS=0: every worker a fresh interpreter, as on a host that
# runs `collectives-server worker` itself.
FORK_WORKERS_ENV = "COLLECTIVES_TEST_FORK_WORKERS"


# The daemons the zygote forks: it has imported each (preloaded_workers.SERVER_PRELOAD).
_FORKED_COMMANDS = ("worker", "coordinator", "local")


def _forked_args(argv: Sequence[str]) -> list[str] | None:
    """``ARGS`` of a ``collectives-server ARGS`` command line (a worker, a coordinator
    or a ``local`` launcher) that the zygote can fork; None for any other command (or
    with forking turned off)."""
    if os.environ.get(FORK_WORKERS_ENV, "1") == "0":
        return None
    head = server_argv()
    command = argv[len(head) : len(head) + 1]
    if list(argv[: len(head)]) == head and command and command[0] in _FORKED_COMMANDS:
        return list(argv[len(head) :]) if available(sys.executable) else None
    return None


class Daemon:
    """A daemon (``argv``, usually :func:`server_argv`) as a child in its own process
    group.

    ``start()`` waits (bounded) for the first line of standard output, the
    daemon's address; the rest of standard output is drained by a thread so it
    never blocks on a full pipe. Standard error goes to ``log_path``.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path or log_dir() / f"{name}-{uuid.uuid4().hex[:8]}.log"
        self.env = env
        self.proc: subprocess.Popen[str] | PreloadedProcess | None = None
        self.address = ""
        self._lines: queue.Queue[str | None] = queue.Queue()

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc.pid

    def start(self, timeout_s: float = 90.0) -> str:
        """Starts the daemon and returns the address it prints first (see
        :meth:`begin` and :meth:`wait_address`)."""
        self.begin()
        return self.wait_address(timeout_s)

    def begin(self) -> None:
        """Starts the process without waiting for its address (several daemons can
        then start at once, and each be waited for)."""
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONUNBUFFERED"] = "1"
        forked = _forked_args(self.argv)
        with open(self.log_path, "ab") as log:
            if forked is not None:
                # Own session too: stop() ends the daemon and every child it started.
                self.proc = _zygote().start(
                    forked, env, self.name, stderr=log.fileno(), new_session=True
                )
            else:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=env,
                    # Own process group: stop() ends the daemon and every child it
                    # started, and nothing else.
                    start_new_session=True,
                )
        _STARTED.append(self)
        threading.Thread(target=self._drain, name=f"drain-{self.name}", daemon=True).start()

    def wait_address(self, timeout_s: float = 90.0) -> str:
        """The address the daemon prints first, waited for at most ``timeout_s``.

        Raises:
            DaemonExited: it ended before printing an address (then stopped).
            AssertionError: it printed nothing within ``timeout_s`` (then stopped).
        """
        assert self.proc is not None, f"{self.name} was not started"
        try:
            first = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.stop()
            raise AssertionError(
                f"{self.name} ({' '.join(self.argv)}) printed no address within "
                f"{timeout_s:.0f} s\n{self.log_tail()}"
            ) from None
        match = _ADDRESS_RE.search(first or "")
        if match is None:
            self.stop()
            code = self.proc.poll()
            raise DaemonExited(
                f"{self.name} ({' '.join(self.argv)}) exited with code {code} before "
                f"printing its address; first line: {first!r}\n{self.log_tail()}"
            )
        self.address = match.group(1)
        return self.address

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            text = line.decode(errors="replace") if isinstance(line, bytes) else line
            self._lines.put(text.strip())
        self._lines.put(None)

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the daemon itself (not its group), if it still runs;
        SIGSTOP returns once the daemon is stopped (:func:`stop_process`)."""
        if self.proc is not None and self.proc.poll() is None:
            if sig == SIGSTOP:
                stop_process(self.proc.pid)
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def terminate(self, sig: int = SIGTERM, timeout_s: float = 15.0) -> int:
        """Sends ``sig`` and returns the exit code (waited for at most ``timeout_s``)."""
        assert self.proc is not None, f"{self.name} was not started"
        self.signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is the daemon or a descendant of it, or the coordinator or a
        worker of the cluster it runs (forked by a shared zygote; read from /proc)."""
        if self.proc is None:
            return False
        if self.address:
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                if f"--coordinator={self.address}".encode() in argv:
                    return True
                port = int(self.address.rpartition(":")[2])
                if b"collectives_server coordinator " in argv and listening_pid(port) == pid:
                    return True
        while pid > 1:
            if pid == self.proc.pid:
                return True
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return False
            # Field 4 is the parent pid; the command name (field 2) may hold spaces.
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        return False

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- last lines of {self.log_path} ---\n{tail}"

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGCONT (a stopped daemon must see the next one), SIGTERM, a bounded wait,
        then SIGKILL of the whole process group. Returns the exit code, or None
        if it had to be killed."""
        proc = self.proc
        if proc is None:
            return None
        code: int | None = proc.poll()
        if code is None:
            for sig in (SIGCONT, SIGTERM):
                self.signal(sig)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = None
                # What it was doing instead of ending, in its log (log_tail shows it).
                with contextlib.suppress(OSError), open(self.log_path, "a") as log:
                    log.write(f"--- not ended {timeout_s:g} s after SIGTERM ---\n")
                    log.write(_stuck(proc.pid) + "\n")
        # Whatever it left behind in its group (it should be nothing).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, SIGKILL)
        if code is None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{self.name} (pid {proc.pid}) did not end within {timeout_s:g} s of SIGTERM "
                    f"nor 10 s of SIGKILL, or its end was not reported:\n{_stuck(proc.pid)}\n"
                    f"{self.log_tail()}"
                ) from None
        return code

    def kill(self) -> None:
        """SIGKILL of the whole process group, waited for."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, SIGKILL)
        self.proc.wait(timeout=10)


def _stuck(pid: int) -> str:
    """What a process that did not end is doing, and this test process's zygote (which
    reports the ends of the processes it forked): their state and Python stacks."""
    lines = []
    zygote = _ZYGOTE[0][0].zygote_pid if _ZYGOTE else None
    spy = Path(sys.executable).with_name("py-spy")
    for what, p in (("the process", pid), ("the zygote", zygote)):
        if p is None:
            continue
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            lines.append(f"{what} (pid {p}): gone")
            continue
        state = next((x for x in status.splitlines() if x.startswith("State:")), "State: ?")
        threads = next((x for x in status.splitlines() if x.startswith("Threads:")), "")
        lines.append(f"{what} (pid {p}): {state}, {threads}")
        # Where the kernel has each thread (a process ending in the kernel has no Python).
        for task in sorted(Path(f"/proc/{p}/task").glob("*"))[:32]:
            with contextlib.suppress(OSError):
                stat = (task / "stat").read_text()
                wchan = (task / "wchan").read_text()
                stack = (task / "stack").read_text().strip().replace("\n", " < ")
                lines.append(f"  task {task.name}: {stat[stat.rindex(')') + 2]} {wchan} {stack}")
        if spy.exists():
            dump = subprocess.run(
                [str(spy), "dump", "--pid", str(p)], capture_output=True, text=True, timeout=20
            )
            lines.append(dump.stdout[-6000:] or dump.stderr[-2000:])
    return "\n".join(lines)


def launch(
    argv: Sequence[str], log_path: Path | None = None, timeout_s: float = 60.0, name: str = ""
) -> Daemon:
    """A started :class:`Daemon` running ``argv``."""
    daemon = Daemon(name or Path(argv[0]).name, argv, log_path)
    daemon.start(timeout_s)
    return daemon


def spawn(
    name: str, args: Sequence[str], log_path: Path | None = None, timeout_s: float = 60.0
) -> Daemon:
    """A started ``collectives-server ARGS`` daemon named ``name``."""
    return launch(server_argv(*args), log_path, timeout_s, name)


class LocalCluster(Daemon):
    """``python -m collectives_server local --workers N --port 0 EXTRA`` as a daemon:
    the coordinator address is its first line; ``stop()`` ends every child. Its
    workers are forked by this test process's zygote (:func:`share_zygote`), unless
    ``shared_zygote`` is False: then by the launcher's own, as for a user."""

    def __init__(
        self,
        workers: int,
        extra_args: Sequence[str],
        log_path: Path,
        shared_zygote: bool = True,
    ) -> None:
        super().__init__(
            f"local{workers}",
            server_argv("local", "--workers", str(workers), "--port", "0", *extra_args),
            log_path,
        )
        self.workers = workers
        self.shared_zygote = shared_zygote

    def begin(self) -> None:
        forking = os.environ.get(FORK_WORKERS_ENV, "1") != "0"
        if self.shared_zygote and forking and available(sys.executable):
            self.env = {**os.environ, ZYGOTE_ENV: share_zygote()}
        else:
            self.env = {k: v for k, v in os.environ.items() if k != ZYGOTE_ENV}
        super().begin()


# --------------------------------------------------------------------------- stopping


def stop_process(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP to ``pid``, returning once every thread of it is stopped.

    ``kill`` only queues the signal: the process stops when one of its threads
    handles it, and on a loaded machine that thread may wait for a CPU while
    the others (a gRPC poller) still answer calls. A test that stops a worker
    to make a call wait must not send the call before then.

    Raises:
        AssertionError: some thread still ran after ``timeout_s`` (the process
            is left stopped-pending, as the caller asked).
    """
    os.kill(pid, SIGSTOP)
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()  # never set: a bounded wait between looks
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} not stopped {timeout_s:g} s after SIGSTOP")
        pause.wait(0.001)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: nothing of it runs
    for task in tasks:
        try:
            state = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue  # the thread ended
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


# --------------------------------------------------------------------------- ports


def listening_pid(port: int) -> int | None:
    """The process with a TCP socket listening on ``port`` (any local address), from
    /proc; None if there is none. A ``local`` launcher's coordinator is forked by the
    zygote, not by the launcher: its listening port is what ties it to its cluster."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # fields[3] == "0A": LISTEN; fields[9]: the socket's inode.
                if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                        return int(entry)
    return None


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _own_ports() -> range:
    """The ports this test process may hand out: below the ephemeral range, and the
    slice of it that belongs to this pytest-xdist worker (all of it without xdist)."""
    low, high = 10000, _ephemeral_low()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return range(low, high)
    index = int(worker[2:])
    width = (high - low) // count
    return range(low + index * width, low + (index + 1) * width)


# Every port free_port_block returned in this process.
_HANDED_OUT: set[int] = set()


def free_port_block(count: int = 1) -> int:
    """A port P such that P .. P+count-1 are free on 127.0.0.1 right now, for a daemon
    told its port on the command line. Chosen below the kernel's ephemeral range: a
    port inside it (what binding port 0 returns) can be taken by any outgoing
    connection before the daemon binds it; and from this process's own slice, so
    another test process never picks it. Never one this process handed out before: a
    daemon stopped for a while (an etcd outage) binds its port again when it comes
    back, and a port free meanwhile is not free for another daemon."""
    ports = _own_ports()
    for _ in range(200):
        base = random.randrange(ports.start, ports.stop - count)
        block = range(base, base + count)
        if any(port in _HANDED_OUT for port in block):
            continue
        sockets = []
        try:
            for port in block:
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            _HANDED_OUT.update(block)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found in {ports}")


def free_port() -> int:
    """A port free on 127.0.0.1 right now (see :func:`free_port_block`)."""
    return free_port_block(1)
