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
with its parent (:data:`PARENT_PID_ENV`) then gets its SIGTERM.

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
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import IO, NoReturn

import setproctitle

from collectives_server.cli.common import PARENT_PID_ENV

__all__ = ["SERVER_MAIN", "SERVER_PRELOAD", "PreloadedProcess", "PreloadedWorkers", "available"]

# The zygote's default entry point (``module:function``, called with a worker's
# arguments) and what it imports once: the command line and the worker daemon.
SERVER_MAIN = "collectives_server.cli.main:main"
SERVER_PRELOAD = ("collectives_server.cli.main", "collectives_server.worker.daemon")
_MAX_MESSAGE = 1 << 20
_READY, _STARTED, _EXITED = b"R", b"P", b"X"


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
    ) -> None:
        self._python = python
        self._entry = entry  # what each forked child runs, ``module:function``
        self._preload = preload
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
        its standard error on the descriptor ``stderr`` (None: the zygote's, which is
        this process's), in a session and process group of its own if ``new_session``.

        Raises:
            RuntimeError: the zygote could not be started or has ended.
        """
        read_fd, write_fd = os.pipe()
        try:
            with self._lock:
                sock = self._running()
                request = {"args": args, "env": env, "new_session": new_session}
                fds = [write_fd] if stderr is None else [write_fd, stderr]
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

    def _running(self) -> socket.socket:
        """The zygote's socket, starting the zygote the first time (lock held)."""
        if self._ended:
            raise RuntimeError("the worker zygote ended")
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._zygote = subprocess.Popen(
                [
                    self._python,
                    "-m",
                    "collectives_server.preloaded_workers",
                    str(theirs.fileno()),
                    self._entry,
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
def _serve(sock: socket.socket, entry: Callable[[list[str]], int]) -> None:
    """The zygote's loop: fork a worker per request, report each one's exit; return
    when the launcher's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; workers restore it
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through wake_w
    sock.send(_READY)
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_r:
                    os.read(wake_r, 4096)
                    _report_exits(sock)
                    continue
                try:
                    message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
                except OSError:
                    message, fds = b"", []
                if not message:
                    return
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    _become_worker(sock, (wake_r, wake_w), entry, request, fds)
                for fd in fds:
                    os.close(fd)
                sock.send(_STARTED + str(pid).encode())
            _report_exits(sock)


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            sock.send(_EXITED + f"{pid} {code}".encode())


def _become_worker(
    sock: socket.socket,
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
        sock.close()
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
    """``python -m collectives_server.preloaded_workers FD MODULE:FUNCTION PRELOAD...``"""
    fd, entry, *preload = sys.argv[1:]
    sock = socket.socket(fileno=int(fd))
    for module in preload:
        importlib.import_module(module)
    module, function = entry.split(":")
    _serve(sock, getattr(importlib.import_module(module), function))


if __name__ == "__main__":
    main()
