"""Worker processes forked from an interpreter that has already imported them.

A fresh ``python -m collectives_server worker`` spends about two CPU-seconds
importing torch and the worker's modules before it does anything; ``local``
with eight workers would spend sixteen, and a restarted worker keeps its
replacement waiting as long. :class:`PreloadedWorkers` starts one *zygote*
(``python -m collectives_server.preloaded_workers``), a child that imports them
once, then only forks: it touches no GPU, opens no network socket and starts no
thread, so each fork starts as a fresh interpreter would, minus the import, and
runs ``collectives-server worker ARGS``. CUDA is first initialised in the worker
itself, as it must be after a fork.

The zygote and its launcher talk over one ``AF_UNIX`` ``SOCK_SEQPACKET`` pair: a
request is the worker's arguments and environment (JSON) with the write end of
its standard-output pipe attached (``SCM_RIGHTS``); the answer is its pid; and
the zygote, its parent, reports each worker's exit status as it reaps it. The
zygote exits when the launcher closes its end (or dies); a worker asked to die
with its parent (:data:`PARENT_PID_ENV`) then gets its SIGTERM. A zygote may also
listen on a Unix socket path (mode 0600, peers of another uid refused) and serve
other launchers of the same user (:data:`ZYGOTE_ENV`), so that several local
clusters on one host import torch once between them; when such a launcher's
connection closes (it stopped, or died), the workers it started and did not stop
are resumed and sent SIGTERM.

A started worker is a :class:`PreloadedProcess`, which the launcher treats as a
``subprocess.Popen``: its pid, its standard output on a pipe, standard input
``/dev/null``, standard error the launcher's, ``send_signal``, ``wait`` and
``poll`` with the same return codes (negative: killed by that signal). Its
environment is the one given, applied before the worker's code runs
(``OMP_NUM_THREADS`` through ``torch.set_num_threads``, since OpenMP read it
when the zygote imported torch).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import IO, NoReturn

import setproctitle

from collectives_server import gc_tuning as heap
from collectives_server.cli.common import PARENT_PID_ENV

__all__ = [
    "SERVER_MAIN",
    "SERVER_PRELOAD",
    "ZYGOTE_ENV",
    "PreloadedProcess",
    "PreloadedWorkers",
    "available",
]

# A launcher that finds this set uses the zygote serving on that Unix socket path
# (started by another launcher of this user with ``listen``) instead of its own.
ZYGOTE_ENV = "COLLECTIVES_WORKER_ZYGOTE"
# A started worker's standard error, unless the launcher names another descriptor.
STDERR_FILENO = 2

# The zygote's default entry point (``module:function``, called with a daemon's
# arguments) and what it imports once: the command line, the worker daemon, and the
# coordinator (``local`` forks its coordinator from the zygote too).
SERVER_MAIN = "collectives_server.cli.main:main"
SERVER_PRELOAD = (
    "collectives_server.cli.main",
    "collectives_server.worker.daemon",
    "collectives_server.coordinator.daemon",
)
_MAX_MESSAGE = 1 << 20
_READY, _STARTED, _EXITED = b"R", b"P", b"X"
# What a launcher stops its workers with (blocked over a fork: _serve_request).
_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def available(python: str) -> bool:
    """Whether workers for ``python`` can be forked from a preloaded interpreter: the
    same interpreter as this one, on Linux."""
    return python == sys.executable and sys.platform.startswith("linux")


class PreloadedProcess:
    """A worker forked by the zygote, with the parts of ``Popen`` a launcher uses."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waited for at most ``timeout`` seconds.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout``.
        """
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreloadedWorkers:
    """Starts ``collectives-server worker`` processes from one preloaded zygote (started
    with the first worker); :meth:`close` ends the zygote once its workers are gone."""

    def __init__(
        self,
        python: str = sys.executable,
        entry: str = SERVER_MAIN,
        preload: tuple[str, ...] = SERVER_PRELOAD,
        listen: str | None = None,
        connect: str | None = None,
    ) -> None:
        """``listen``: the zygote this starts also serves other launchers of this user on
        that Unix socket path. ``connect``: start no zygote; use the one serving there."""
        self._python = python
        self._entry = entry  # what each forked child runs, ``module:function``
        self._preload = preload
        self._listen_path = listen
        self._connect_path = connect
        self._lock = threading.Lock()  # one request at a time; guards the fields below
        self._zygote: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._started: list[int] = []  # pids answered, taken by the requester
        self._answered = threading.Condition(self._lock)
        self._live: dict[int, PreloadedProcess] = {}
        self._early: dict[int, int] = {}  # exit codes reported before the pid was claimed
        self._ended = False

    @property
    def zygote_pid(self) -> int | None:
        """The zygote's pid once started (None before the first worker)."""
        return self._zygote.pid if self._zygote is not None else None

    def start(
        self,
        args: list[str],
        env: dict[str, str],
        name: str = "worker",
        stderr: int | None = None,
        new_session: bool = False,
    ) -> PreloadedProcess:
        """``collectives-server ARGS`` (a worker) with exactly ``env`` as its environment;
        its standard error on the descriptor ``stderr`` (None: this process's, also
        when the zygote is another launcher's), in a session and process group of its
        own if ``new_session``.

        Raises:
            RuntimeError: the zygote could not be started or has ended.
        """
        read_fd, write_fd = os.pipe()
        try:
            with self._lock:
                sock = self._running()
                request = {"args": args, "env": env, "new_session": new_session}
                fds = [write_fd, STDERR_FILENO if stderr is None else stderr]
                socket.send_fds(sock, [json.dumps(request).encode()], fds)
                if not self._answered.wait_for(lambda: self._started or self._ended, 60.0):
                    raise RuntimeError(f"the worker zygote did not start {name} within 60 s")
                if not self._started:
                    raise RuntimeError("the worker zygote ended")
                pid = self._started.pop(0)
                process = PreloadedProcess(pid, os.fdopen(read_fd, "rb"))
                read_fd = -1
                if pid in self._early:
                    process._exit(self._early.pop(pid))
                else:
                    self._live[pid] = process
                return process
        finally:
            os.close(write_fd)  # the worker holds the only write end: EOF when it exits
            if read_fd >= 0:
                os.close(read_fd)

    def ensure_started(self) -> None:
        """Starts (or connects to) the zygote now rather than with the first worker."""
        with self._lock:
            self._running()

    def _running(self) -> socket.socket:
        """The zygote's socket, starting the zygote the first time (lock held)."""
        if self._ended:
            raise RuntimeError("the worker zygote ended")
        if self._sock is not None:
            return self._sock
        if self._connect_path is not None:
            return self._connected(self._connect_path)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._zygote = subprocess.Popen(
                [
                    self._python,
                    "-m",
                    "collectives_server.preloaded_workers",
                    str(theirs.fileno()),
                    self._entry,
                    self._listen_path or "-",
                    *self._preload,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
            )
        finally:
            theirs.close()
        ours.settimeout(120.0)  # importing torch, on a loaded machine
        try:
            ready = ours.recv(16)
        except TimeoutError:
            ready = b""
            self._zygote.kill()
        ours.settimeout(None)
        if ready != _READY:
            ours.close()
            self._zygote.wait(10)
            self._ended = True
            raise RuntimeError("the worker zygote failed to import the worker (see its log)")
        self._sock = ours
        threading.Thread(target=self._listen, args=(ours,), name="zygote", daemon=True).start()
        return ours

    def _connected(self, path: str) -> socket.socket:
        """A connection to the zygote serving at ``path`` (lock held)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(30.0)
            sock.connect(path)
            ready = sock.recv(16)
            sock.settimeout(None)
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"no worker zygote serves at {path}: {exc}") from None
        if ready != _READY:
            sock.close()
            raise RuntimeError(f"the worker zygote at {path} did not answer")
        self._sock = sock
        threading.Thread(target=self._listen, args=(sock,), name="zygote", daemon=True).start()
        return sock

    def _listen(self, sock: socket.socket) -> None:
        """The zygote's answers and exit reports; on its end, what it left is killed."""
        while True:
            try:
                message = sock.recv(_MAX_MESSAGE)
            except OSError:
                message = b""
            if not message:
                break
            kind, body = message[:1], message[1:]
            with self._lock:
                if kind == _STARTED:
                    self._started.append(int(body))
                    self._answered.notify_all()
                elif kind == _EXITED:
                    pid, code = (int(v) for v in body.split(b" "))
                    process = self._live.pop(pid, None)
                    if process is None:
                        self._early[pid] = code
                    else:
                        process._exit(code)
        with self._lock:
            self._ended = True
            self._answered.notify_all()
            orphans, self._live = list(self._live.values()), {}
        for process in orphans:  # the zygote died under them: end them, report killed
            process.kill()
            process._exit(-signal.SIGKILL)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ends the zygote (its workers should be gone by now) and waits for it."""
        with self._lock:
            sock, self._sock = self._sock, None
            zygote = self._zygote
            self._ended = True  # no zygote is started again
            self._answered.notify_all()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if zygote is not None:
            try:
                zygote.wait(timeout_s)
            except subprocess.TimeoutExpired:
                zygote.kill()
                zygote.wait(timeout_s)


# ------------------------------------------------------------------ the zygote itself
class _Zygote:
    """The zygote's state: its owner's connection (it lives as long as that), other
    launchers' connections (when it listens), and which connection started each child."""

    def __init__(self, owner: socket.socket, listener: socket.socket | None) -> None:
        self.owner = owner
        self.listener = listener
        self.clients: dict[socket.socket, set[int]] = {owner: set()}
        self.started_by: dict[int, socket.socket] = {}

    def report_exits(self) -> None:
        """Reaps every ended child and tells the connection that started it."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            client = self.started_by.pop(pid, None)
            if client is None:
                continue
            self.clients.get(client, set()).discard(pid)
            with contextlib.suppress(OSError):
                client.send(_EXITED + f"{pid} {os.waitstatus_to_exitcode(status)}".encode())

    def drop(self, client: socket.socket) -> None:
        """A launcher's connection closed (it stopped, or died): what it started and did
        not stop ends now (resumed if stopped, then SIGTERM), as its own children would."""
        for pid in self.clients.pop(client, set()):
            self.started_by.pop(pid, None)
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        client.close()


def _serve(
    owner: socket.socket, listener: socket.socket | None, entry: Callable[[list[str]], int]
) -> None:
    """The zygote's loop: fork a worker per request, report each one's exit to whoever
    asked for it; return when the owner's connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; workers restore it
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through wake_w
    zygote = _Zygote(owner, listener)
    owner.send(_READY)
    with selectors.DefaultSelector() as selector:
        selector.register(owner, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        if listener is not None:
            selector.register(listener, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_r:
                    os.read(wake_r, 4096)
                elif key.fileobj is listener:
                    _accept(zygote, selector)
                else:
                    client = key.fileobj
                    assert isinstance(client, socket.socket)
                    if not _serve_request(zygote, client, (wake_r, wake_w), entry):
                        if client is owner:
                            return
                        selector.unregister(client)
                        zygote.drop(client)
            zygote.report_exits()


def _accept(zygote: _Zygote, selector: selectors.BaseSelector) -> None:
    """A launcher of this user connecting to a listening zygote (anyone else: refused)."""
    assert zygote.listener is not None
    try:
        client, _ = zygote.listener.accept()
    except OSError:
        return
    creds = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        client.close()
        return
    zygote.clients[client] = set()
    selector.register(client, selectors.EVENT_READ)
    with contextlib.suppress(OSError):
        client.send(_READY)


def _serve_request(
    zygote: _Zygote,
    client: socket.socket,
    wake: tuple[int, int],
    entry: Callable[[list[str]], int],
) -> bool:
    """Forks the worker ``client`` asks for; False when ``client`` has closed."""
    try:
        message, fds, _, _ = socket.recv_fds(client, _MAX_MESSAGE, 2)
    except OSError:
        message, fds = b"", []
    if not message:
        return False
    request = json.loads(message)
    # The zygote ignores SIGINT, and a child inherits that until it sets its own: a
    # SIGINT or SIGTERM its launcher sends right after the fork (stopping everything
    # as a restart starts) would be lost, and the worker would run on. Blocked over
    # the fork, such a signal waits in the child until its own dispositions are set.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        raise
    if pid == 0:
        _become_worker(zygote, wake, entry, request, fds)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    for fd in fds:
        os.close(fd)
    zygote.clients[client].add(pid)
    zygote.started_by[pid] = client
    with contextlib.suppress(OSError):
        client.send(_STARTED + str(pid).encode())
    return True


def _become_worker(
    zygote: _Zygote,
    wake: tuple[int, int],
    entry: Callable[[list[str]], int],
    request: dict,
    fds: list[int],
) -> NoReturn:
    """In the forked child: standard output to the pipe (``fds[0]``), standard error to
    ``fds[1]`` if given, the request's environment, then ``collectives-server ARGS`` as
    ``python -m collectives_server`` would run it."""
    code = 1
    try:
        for connection in [*zygote.clients, zygote.listener]:
            if connection is not None:
                connection.close()
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["new_session"]:
            os.setsid()
        for target, fd in zip((1, 2), fds, strict=False):
            os.dup2(fd, target)
            os.close(fd)
        args, env = request["args"], request["env"]
        # ps and /proc/PID/cmdline show the worker's own command line, not the zygote's.
        setproctitle.setproctitle(shlex.join([sys.executable, "-m", "collectives_server", *args]))
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        if PARENT_PID_ENV in env:
            # Its parent is the zygote, which ends with the launcher.
            os.environ[PARENT_PID_ENV] = str(os.getppid())
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        # Until the worker installs its own handlers, SIGINT ends it as SIGTERM does
        # (a launcher stopping everything may send it while a restart still starts),
        # not with a KeyboardInterrupt traceback from wherever it is. One sent since
        # the fork is delivered now (see _serve_request).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        code = entry(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # a worker's crash, reported as a process's would be
        traceback.print_exc()
        code = 1
    # Unwinds the zygote's loop in this child only: the interpreter then exits as a
    # fresh one would (standard streams flushed, atexit handlers, threads joined).
    raise SystemExit(code)


def main() -> None:
    """``python -m collectives_server.preloaded_workers FD MODULE:FUNCTION LISTEN PRELOAD...``
    (LISTEN: a Unix socket path to serve other launchers on, or ``-``)."""
    fd, entry, listen, *preload = sys.argv[1:]
    owner = socket.socket(fileno=int(fd))
    for module in preload:
        importlib.import_module(module)
    # Everything imported goes to the collector's permanent generation before any
    # fork: a child's collections then never walk (nor write to, un-sharing its pages)
    # the preloaded heap, which a forked coordinator's first collection did for
    # seconds on a loaded machine, answering nothing meanwhile.
    heap.settle()
    module, function = entry.split(":")
    listener = None
    if listen != "-":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen)  # a dead zygote's, left behind
        old_mask = os.umask(0o177)  # this user only
        try:
            listener.bind(listen)
        finally:
            os.umask(old_mask)
        listener.listen(64)
    zygote_pid = os.getpid()
    try:
        _serve(owner, listener, getattr(importlib.import_module(module), function))
    finally:
        # A forked worker unwinds through here too: only the zygote removes its path.
        if listener is not None and os.getpid() == zygote_pid:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(listen)


if __name__ == "__main__":
    main()
