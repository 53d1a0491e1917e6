"""Nothing left behind: a pytest plugin that fails the run if it leaves a process, a
``/dev/shm`` segment or a temporary file or directory outside pytest's own.

The first pytest process of a run (the xdist controller, or the only process)
notes what ``/dev/shm`` and the temporary directory hold, and puts in its
environment, which every process started from the run inherits (xdist
workers, daemons, their children, browsers, etcd), a run id and a ``TMPDIR``
of the run's own under pytest's temporary root: what they write there is
removed with it at the end, whoever wrote it (a daemon a test killed cannot
clean up). After each test, each pytest process writes what appeared in
``/dev/shm`` and the temporary directory since its last look to a ledger, with
the test's id. At the end, the first process lists what is still there that
was not at the start, names the test that first saw each, kills the processes
and removes the segments, and fails the run.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest

RUN_ID_ENV = "COLLECTIVES_TEST_RUN_ID"
_LEDGER_ENV = "COLLECTIVES_TEST_LEDGER"
_SHM = Path("/dev/shm")


def _is_first_process(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


# The machine's temporary directory, before this run points TMPDIR at its own.
_MACHINE_TMP = Path(tempfile.gettempdir())


def _pytest_own(tmp: Path) -> Path:
    """pytest's own temporary root (``pytest-of-<user>``), which is never ours to check."""
    return tmp / f"pytest-of-{getpass.getuser()}"


def _entries() -> set[str]:
    """What /dev/shm and the temporary directory hold now, as "shm:NAME" / "tmp:NAME"."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        found.update(f"shm:{name}" for name in os.listdir(_SHM))
    own = _pytest_own(_MACHINE_TMP).name
    with contextlib.suppress(OSError):
        found.update(f"tmp:{name}" for name in os.listdir(_MACHINE_TMP) if name != own)
    return found


def _run_processes(run_id: str) -> dict[int, str]:
    """pid -> command line of every live process carrying this run's id, but this one."""
    found: dict[int, str] = {}
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            if marker not in environ.split(b"\0"):
                continue
            status = Path(f"/proc/{entry}/stat").read_text()
            if status.rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie: already dead, its parent has yet to reap it
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        found[int(entry)] = cmdline.decode(errors="replace").strip()
    return found


class Leftovers:
    """The plugin's state in one pytest process."""

    def __init__(self, config: pytest.Config) -> None:
        self.first = _is_first_process(config)
        if self.first:
            run_id = os.environ[RUN_ID_ENV] = uuid.uuid4().hex
            own = _pytest_own(_MACHINE_TMP)
            own.mkdir(mode=0o700, exist_ok=True)
            os.environ[_LEDGER_ENV] = str(own / f"collectives-ledger-{run_id}.jsonl")
            # Short: programs put Unix sockets under TMPDIR (108 bytes a path at most).
            scratch = own / f"ctmp-{run_id[:8]}"
            scratch.mkdir(mode=0o700)
            # pytest keeps its own root where it was; everything else goes to scratch.
            os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", str(_MACHINE_TMP))
            os.environ["TMPDIR"] = str(scratch)
            tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        self.run_id = os.environ[RUN_ID_ENV]
        self.ledger = Path(os.environ[_LEDGER_ENV])
        self.scratch = Path(os.environ["TMPDIR"])
        self.seen = _entries()
        self.baseline = set(self.seen)

    def after_test(self, nodeid: str) -> None:
        now = _entries()
        new = now - self.seen
        self.seen |= now
        if new:
            with self.ledger.open("a") as ledger:
                for entry in sorted(new):
                    line = {"entry": entry, "test": nodeid, "at": time.time()}
                    ledger.write(json.dumps(line) + "\n")

    def who_made(self) -> dict[str, str]:
        """entry -> the test during which it first appeared (in any process)."""
        first: dict[str, tuple[float, str]] = {}
        with contextlib.suppress(OSError), self.ledger.open() as ledger:
            for line in ledger:
                row = json.loads(line)
                if row["entry"] not in first or row["at"] < first[row["entry"]][0]:
                    first[row["entry"]] = (row["at"], row["test"])
        return {entry: test for entry, (_, test) in first.items()}

    def collect(self) -> list[str]:
        """What this run left behind, each named with the test that made it. Its
        processes are killed and its shared-memory segments removed; a segment of
        a live process of another run, and anything no test of this run saw
        appear, is left alone (another run on this machine owns it)."""
        problems = []
        for pid, cmdline in sorted(_run_processes(self.run_id).items()):
            problems.append(f"process {pid}: {cmdline}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        made = self.who_made()
        tmp = _MACHINE_TMP
        for entry in sorted(_entries() - self.baseline):
            if entry not in made:
                continue
            kind, name = entry.split(":", 1)
            path = (_SHM if kind == "shm" else tmp) / name
            if kind == "shm" and _owner_alive_elsewhere(name):
                continue
            problems.append(f"{path} (made during {made[entry]})")
            if kind == "shm":
                with contextlib.suppress(OSError):
                    path.unlink()
        self.ledger.unlink(missing_ok=True)
        shutil.rmtree(self.scratch, ignore_errors=True)
        return problems


def _owner_alive_elsewhere(name: str) -> bool:
    """Whether a segment named ``collectives-KIND-PID-...`` belongs to a live process
    other than this one (another test run's, still using it)."""
    parts = name.split("-")
    if len(parts) < 4 or not parts[2].isdigit():
        return False
    pid = int(parts[2])
    return pid != os.getpid() and Path(f"/proc/{pid}").exists()


_KEY = pytest.StashKey[Leftovers]()
_PROBLEMS = pytest.StashKey[list[str]]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.stash[_KEY] = Leftovers(config)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """After each test's teardown: what appeared meanwhile goes to the ledger."""
    leftovers = _CURRENT[0] if _CURRENT else None
    if leftovers is not None:
        leftovers.after_test(nodeid)


_CURRENT: list[Leftovers] = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CURRENT[:] = [session.config.stash[_KEY]]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    leftovers = session.config.stash[_KEY]
    if not leftovers.first:
        return
    problems = leftovers.collect()
    session.config.stash[_PROBLEMS] = problems
    if problems and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    problems = config.stash.get(_PROBLEMS, [])
    if problems:
        terminalreporter.write_sep("=", "left behind by this run (removed now)", red=True)
        for line in problems:
            terminalreporter.write_line(line, red=True)
