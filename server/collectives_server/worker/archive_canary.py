"""Defence in depth: a checked model archive is first loaded in a short-lived child.

``--load-sandbox`` (default on for ``worker``, off for ``local``): before the
worker deserializes an archive that :mod:`archive` accepted, a child process
loads it (``torch.export.load(...).module()``) and exits. Only if the child
loads it cleanly does the worker load it in-process.

What the child gets:

- the archive as its stdin (an open descriptor), nothing else inherited: it
  runs ``python -I`` (no PYTHONPATH, no user site), a minimal environment, no
  other descriptors, its own session;
- resource limits set before it executes: ``RLIMIT_AS`` (2 GiB plus twice
  the archive), ``RLIMIT_CPU`` (the timeout), ``RLIMIT_NOFILE`` (64),
  ``RLIMIT_FSIZE`` 0 (it cannot write files), ``RLIMIT_CORE`` 0, and, when it
  is dropped to ``nobody``, ``RLIMIT_NPROC`` (64);
- a wall-clock timeout (``--model-load-timeout-s``): killed past it, the load
  answers DEADLINE_EXCEEDED;
- when the worker runs as root: the uid/gid of ``nobody`` and no
  supplementary groups, so the archive is opened by the parent and code run by
  a payload cannot read root-only files or write anywhere ``nobody`` cannot.

What it does NOT guarantee: run as a non-root user, the child keeps the
worker's uid (it could read what the worker can read and signal the worker's
processes); there is no network, filesystem or syscall isolation (no
namespaces, no seccomp); a payload that only acts when the model *runs*
(rather than loads) is not exercised. It catches loads that crash, hang,
exhaust memory or fail; the allowlist in :mod:`archive` is what keeps code out.
"""

from __future__ import annotations

import os
import pwd
import resource
import subprocess
import sys
from pathlib import Path

from collectives.errors import DeadlineExceeded, InvalidArgument

__all__ = ["trial_load"]

_CHILD = (
    "import sys, torch\n"
    "torch.export.load(open(0, 'rb', closefd=False)).module()\n"
    "sys.stdout.write('loaded\\n')\n"
)
_NOFILE = 64
_NPROC = 64


def _limits(as_bytes: int, cpu_s: int, drop_to: tuple[int, int] | None):
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_NOFILE, (_NOFILE, _NOFILE))
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if drop_to is not None:
            uid, gid = drop_to
            resource.setrlimit(resource.RLIMIT_NPROC, (_NPROC, _NPROC))
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

    return apply


def _nobody() -> tuple[int, int] | None:
    if os.geteuid() != 0:
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
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LC_ALL": "C"}
    with open(path, "rb") as archive:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", _CHILD],
                stdin=archive,
                capture_output=True,
                timeout=timeout_s,
                env=env,
                cwd="/",
                close_fds=True,
                start_new_session=True,
                preexec_fn=_limits((2 << 30) + 2 * size, max(1, int(timeout_s)), _nobody()),
            )
        except subprocess.TimeoutExpired:
            raise DeadlineExceeded(
                f"the model archive did not load within {timeout_s:g} s in the load "
                "sandbox (--model-load-timeout-s)"
            ) from None
    if done.returncode != 0 or done.stdout.strip() != b"loaded":
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        last = lines[-1][:300] if lines else f"exit status {done.returncode}"
        raise InvalidArgument(f"the model archive failed to load in the load sandbox: {last}")
