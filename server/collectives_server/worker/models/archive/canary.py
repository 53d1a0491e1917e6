"""Defence in depth: a checked model archive is first loaded in a short-lived child.

``--load-sandbox`` (default on for ``worker``, off for ``local``): before the
worker deserializes an archive that :mod:`archive` accepted, a child process
loads it (``torch.export.load(...).module()``) and exits. Only if the child
loads it cleanly does the worker load it in-process.

What the child gets:

- the archive as its stdin (an open descriptor), nothing else inherited: it
  runs ``python -I`` (no PYTHONPATH, no user site), a minimal environment, no
  other descriptors, its own session;
- resource limits it sets on itself before it reads the archive: ``RLIMIT_AS`` (2 GiB plus twice
  the archive), ``RLIMIT_CPU`` (the timeout), ``RLIMIT_NOFILE`` (64),
  ``RLIMIT_FSIZE`` 16 MiB (its own TMPDIR, removed after), ``RLIMIT_CORE`` 0, and, when it
  is dropped to ``nobody``, ``RLIMIT_NPROC`` (64);
- a wall-clock timeout (``--model-load-timeout-s``): killed past it, the load
  answers DEADLINE_EXCEEDED;
- when the worker runs as root and ``nobody`` can reach this Python and torch
  (every folder above them world-searchable): the uid/gid of ``nobody`` and no
  supplementary groups, so the archive is opened by the parent and code run by
  a payload cannot read root-only files or write anywhere ``nobody`` cannot.
  If ``nobody`` cannot run this interpreter (e.g. a pyenv under ``/root``),
  the child keeps root's uid and a warning is logged: limits and timeout still
  apply, the privilege drop does not.

What it does NOT guarantee: run as a non-root user, the child keeps the
worker's uid (it could read what the worker can read and signal the worker's
processes); there is no network, filesystem or syscall isolation (no
namespaces, no seccomp); a payload that only acts when the model *runs*
(rather than loads) is not exercised. It catches loads that crash, hang,
exhaust memory or fail; the allowlist in :mod:`archive` is what keeps code out.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from collectives.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument

__all__ = ["trial_load"]

log = logging.getLogger(__name__)

# The child first limits itself and drops its privileges (before it reads a
# byte of the archive), then loads it. Done in the child rather than in a
# preexec_fn so that the worker spawns it with vfork: forking a process that
# runs gRPC's threads can abort it (gRPC's fork handlers).
_CHILD = (
    "import os, resource, sys\n"
    "as_bytes, cpu_s, nofile, fsize, nproc, uid, gid = map(int, sys.argv[1:8])\n"
    "resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "if uid >= 0:\n"
    "    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))\n"
    "    os.setgroups([]); os.setgid(gid); os.setuid(uid)\n"
    "import torch\n"
    "torch.export.load(open(0, 'rb', closefd=False)).module()\n"
    "sys.stdout.write('loaded\\n')\n"
)
_NOFILE = 64
_NPROC = 64
_FSIZE = 16 << 20  # no file it writes (in its own TMPDIR) grows past 16 MiB


def _child_argv(as_bytes: int, cpu_s: int, drop_to: tuple[int, int] | None) -> list[str]:
    uid, gid = drop_to if drop_to is not None else (-1, -1)
    limits = (as_bytes, cpu_s, _NOFILE, _FSIZE, _NPROC, uid, gid)
    return [sys.executable, "-I", "-c", _CHILD, *map(str, limits)]


def _world_can_reach(path: str) -> bool:
    """Whether any user can read ``path`` and search every folder above it."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


@functools.cache
def _nobody() -> tuple[int, int] | None:
    """nobody's (uid, gid) when running as root and nobody can run this Python and
    torch; else None (the child keeps the worker's user, logged once)."""
    if os.geteuid() != 0:
        return None
    import torch

    needed = (sys.executable, os.__file__, torch.__file__)
    if not all(_world_can_reach(p) for p in needed):
        log.warning(
            "load sandbox: running as root, but user nobody cannot reach this Python or "
            "torch (%s); the sandbox keeps root's uid (limits and timeout still apply)",
            ", ".join(os.path.realpath(p) for p in needed),
        )
        return None
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return (65534, 65534)
    return (entry.pw_uid, entry.pw_gid)


def trial_load(path: Path, timeout_s: float) -> None:
    """Loads the checked archive at ``path`` in a limited child process.

    Raises:
        InvalidArgument: the child failed to load it (crash, error, memory).
        DeadlineExceeded: it did not finish within ``timeout_s``.
    """
    size = path.stat().st_size
    drop_to = _nobody()
    with tempfile.TemporaryDirectory(prefix="collectives-sandbox-") as tmp:
        if drop_to is not None:
            os.chown(tmp, *drop_to)
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LC_ALL": "C", "TMPDIR": tmp}
        done = _run_child(path, size, env, drop_to, timeout_s)
    if done.returncode != 0 or done.stdout.strip() != b"loaded":
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        last = lines[-1][:300] if lines else f"exit status {done.returncode}"
        raise InvalidArgument(f"the model archive failed to load in the load sandbox: {last}")


def _run_child(
    path: Path, size: int, env: dict[str, str], drop_to: tuple[int, int] | None, timeout_s: float
) -> subprocess.CompletedProcess:
    with open(path, "rb") as archive:
        try:
            done = subprocess.run(
                _child_argv((2 << 30) + 2 * size, max(1, int(timeout_s)), drop_to),
                stdin=archive,
                capture_output=True,
                timeout=timeout_s,
                env=env,
                cwd="/",
                close_fds=True,
                start_new_session=True,
            )
        except OSError as exc:
            raise FailedPrecondition(
                f"the load sandbox could not start ({exc.strerror}); fix it or start the "
                "worker with --no-load-sandbox"
            ) from None
        except subprocess.TimeoutExpired:
            raise DeadlineExceeded(
                f"the model archive did not load within {timeout_s:g} s in the load "
                "sandbox (--model-load-timeout-s)"
            ) from None
    return done
