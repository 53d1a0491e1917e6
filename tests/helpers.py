"""Shared test machinery: real local clusters, polling with a deadline, and the
local torch oracle every collective is checked against.

The integration tests treat the service as a black box: they start
``python -m collectives_server local`` as a child process, talk to it only
through the public SDK (``import collectives``) or plain gRPC, and compare
every result with what torch computes locally on the same inputs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = [
    "BITWISE_OPS",
    "REDUCE_OPS",
    "LocalCluster",
    "assert_tensor",
    "get_each",
    "make_input",
    "metrics_endpoints",
    "op_valid",
    "put_each",
    "reduce_oracle",
    "required_binary",
    "wait_until",
]

# Every test cluster gets quick failure detection and a short op timeout.
HEARTBEAT_S = 0.2
LEASE_S = 2.0
OP_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 60.0
# The worker token of the clusters the fixtures start (`local --worker-token-file`):
# known to tests that call the coordinator's worker-only RPCs themselves.
WORKER_TOKEN = "collectives-tests-worker-token"


def worker_token_file(directory: Path) -> Path:
    """A file holding :data:`WORKER_TOKEN` (mode 0600) in ``directory``."""
    path = directory / "worker-token"
    if not path.exists():
        path.write_text(WORKER_TOKEN)
        path.chmod(0o600)
    return path


CLUSTER_FLAGS = (
    "--heartbeat",
    str(HEARTBEAT_S),
    "--lease",
    str(LEASE_S),
    "--op-timeout-s",
    str(OP_TIMEOUT_S),
    # Tests that kill a worker expect the cluster to shrink; restarts are tested
    # on their own (tests/integration/test_local_restarts.py).
    "--max-restarts",
    "0",
)


def required_binary(name: str, missing: str) -> str:
    """The path of ``name`` on PATH; skips the test without it, fails with CI=true
    (CI installs what the tests need, so a missing one there is a CI bug)."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but this test cannot run: {missing}")
        pytest.skip(missing)
    return path


# --------------------------------------------------------------------------- time


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_block(count: int = 1) -> int:
    """A port P such that P .. P+count-1 are free on 127.0.0.1 right now, for a daemon
    told its port on the command line. Chosen below the kernel's ephemeral range: a
    port inside it (what binding port 0 returns) can be taken by any outgoing
    connection before the daemon binds it, and a worker once failed to start on
    "Address already in use" that way."""
    ephemeral_low = _ephemeral_low()
    for _ in range(200):
        base = random.randrange(10000, ephemeral_low - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found")


def free_port() -> int:
    """A port free on 127.0.0.1 right now, outside the ephemeral range (see
    :func:`free_port_block`)."""
    return free_port_block(1)


def wait_until(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
) -> Any:
    """Polls ``predicate`` until it returns something truthy; returns that value.

    Fails the test with ``what`` in the message if ``timeout_s`` passes first.
    Exceptions from ``predicate`` count as "not yet" (the last one is reported).
    This is the only place the tests wait: on a condition, with a deadline.
    """
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
        except Exception as exc:
            value, last_exc = None, exc
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc is not None else ""
            raise AssertionError(f"timed out after {timeout_s:.1f} s waiting for {what}{detail}")
        time.sleep(interval_s)  # polling interval, not synchronisation


# ----------------------------------------------------------------------- clusters

_ADDRESS_RE = re.compile(r"((?:\[[0-9A-Fa-f:]+\]|[A-Za-z0-9_.-]+):\d{1,5})")


class LocalCluster:
    """``python -m collectives_server local`` as a child process.

    The launcher prints the coordinator address on its first stdout line; the
    rest of its stdout is drained by a thread (so it never blocks on a full
    pipe) and its stderr goes to ``log_path`` for diagnostics.
    """

    def __init__(self, workers: int, extra_args: Sequence[str], log_path: Path) -> None:
        self.workers = workers
        self.argv = [
            sys.executable,
            "-m",
            "collectives_server",
            "local",
            "--workers",
            str(workers),
            "--port",
            "0",
            *extra_args,
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stdout: list[str] = []

    def start(self, timeout_s: float = 90.0) -> str:
        """Starts the launcher and returns the coordinator address it prints."""
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            # Own process group: the teardown's last resort kills the launcher
            # and every child it started, and nothing else.
            start_new_session=True,
        )
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            first = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.stop()
            raise RuntimeError(
                f"{' '.join(self.argv)} printed no address within {timeout_s:.0f} s\n"
                + self.log_tail()
            ) from None
        match = _ADDRESS_RE.search(first or "")
        if match is None:
            code = self.proc.poll()
            self.stop()
            raise RuntimeError(
                f"{' '.join(self.argv)} (exit code {code}) did not print HOST:PORT first; "
                f"first line: {first!r}\n" + self.log_tail()
            )
        self.address = match.group(1)
        return self.address

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._stdout.append(line)
            self._lines.put(line.strip())
        self._lines.put(None)

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is the launcher or a descendant of it (read from /proc)."""
        if self.proc is None:
            return False
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
        """SIGTERM, wait (bounded), then SIGKILL the whole process group.

        Returns the launcher's exit code, or None if it had to be killed.
        """
        proc = self.proc
        if proc is None:
            return None
        code: int | None = proc.poll()
        if code is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = None
        # Whatever the launcher left behind in its group (it should be nothing).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if code is None:
            proc.wait(timeout=10)
        if not self._log.closed:
            self._log.close()
        return code


def internal_lines(log_path: Path) -> list[str]:
    """The lines of a daemon log that report an INTERNAL status or error."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    marks = ("INTERNAL", "internal error (id")
    return [
        f"{log_path.name}: {line}" for line in text.splitlines() if any(m in line for m in marks)
    ]


# ------------------------------------------------------------------------ oracle

REDUCE_OPS = ("sum", "product", "min", "max", "avg", "band", "bor", "bxor")
BITWISE_OPS = ("band", "bor", "bxor")


def op_valid(op: str, dtype: torch.dtype) -> bool:
    """Whether the contract admits ``op`` on ``dtype``."""
    if op in BITWISE_OPS:
        return not (dtype.is_floating_point or dtype.is_complex)
    if op == "avg":
        return dtype.is_floating_point or dtype.is_complex
    return True


_BOOL_BINARY = {
    # Like NCCL: on bool, sum is logical or, product logical and.
    "sum": torch.logical_or,
    "product": torch.logical_and,
    "min": torch.logical_and,
    "max": torch.logical_or,
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}
_BINARY = {
    "sum": torch.add,
    "product": torch.mul,
    "min": torch.minimum,
    "max": torch.maximum,
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}


def reduce_oracle(op: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """What reducing ``tensors`` (one per rank) with ``op`` must give.

    Floating sums, products and averages are computed in float64 and rounded
    once, the most accurate reference; results are compared with a tolerance.
    Integer arithmetic wraps in the tensor's own dtype, as on the workers.
    """
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        return functools.reduce(_BOOL_BINARY[op], tensors)
    if dtype.is_floating_point and op in ("sum", "product", "avg"):
        wide = [t.to(torch.float64) for t in tensors]
        out = torch.stack(wide).mean(0) if op == "avg" else functools.reduce(_BINARY[op], wide)
        return out.to(dtype)
    return functools.reduce(_BINARY[op], tensors)


def make_input(dtype: torch.dtype, shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """Random data of ``dtype``; integer ranges keep products of 3 ranks in range."""
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        return torch.randint(-50, 51, shape, generator=gen, dtype=dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


_TOLERANCE = {
    torch.float16: {"rtol": 1e-2, "atol": 2e-2},
    torch.bfloat16: {"rtol": 2e-2, "atol": 1e-1},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.complex64: {"rtol": 1e-5, "atol": 1e-5},
    torch.complex128: {"rtol": 1e-12, "atol": 1e-12},
}


def assert_tensor(
    actual: object, expected: torch.Tensor, *, exact: bool = True, what: str = ""
) -> None:
    """Same dtype, shape and (bit-exact, or within the dtype's tolerance) values.

    ``exact=False`` is for floating reductions, whose rounding depends on the
    order in which the backend adds.
    """
    prefix = f"{what}: " if what else ""
    assert isinstance(actual, torch.Tensor), f"{prefix}expected a torch.Tensor, got {actual!r}"
    assert actual.device.type == "cpu", f"{prefix}expected a CPU tensor, got {actual.device}"
    assert actual.dtype == expected.dtype, f"{prefix}dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, (
        f"{prefix}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    tol = _TOLERANCE.get(expected.dtype)
    if exact or tol is None:
        assert torch.equal(actual, expected), (
            f"{prefix}values differ:\nactual   {actual}\nexpected {expected}"
        )
    else:
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{prefix}{m}")


# ------------------------------------------------------------------- SDK helpers


def put_each(cluster: Any, name: str, tensors: Sequence[torch.Tensor]) -> None:
    """Puts ``tensors[r]`` on rank ``r``."""
    for rank, t in enumerate(tensors):
        cluster.put(name, t, rank=rank)


def get_each(cluster: Any, name: str, ranks: Sequence[int] | None = None) -> list[torch.Tensor]:
    """``cluster.get(name, rank=r)`` for every rank (or the given ones)."""
    if ranks is None:
        ranks = range(cluster.world_size)
    return [cluster.get(name, rank=r) for r in ranks]


class AddressedDaemon:
    """A daemon child process whose first stdout line is its address.

    ``log``: where its standard error goes (default: inherited).
    """

    def __init__(
        self, argv: Sequence[str], log: Path | None = None, start_timeout_s: float = 60.0
    ) -> None:
        self._log = open(log, "a") if log is not None else None  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
            text=True,
        )  # fmt: skip
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, args=(lines,), daemon=True).start()
        try:
            self.address = lines.get(timeout=start_timeout_s).strip()
        except queue.Empty:
            self.kill()
            raise AssertionError(f"{argv} printed no address in {start_timeout_s} s") from None
        assert self.address, f"{argv} exited ({self.proc.poll()}) without printing its address"

    def _drain(self, lines: queue.Queue[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.put(line)
        lines.put("")

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()


_METRICS_ENDPOINT = re.compile(r"(coordinator|worker) metrics at http://(\S+)/metrics")


def metrics_endpoints(log_path: Path, workers: int) -> dict[str, list[str]] | None:
    """{"coordinator": [address], "worker": [address, ...]}: the /metrics endpoints a
    ``local --metrics-port 0`` cluster logged, once all are there (else None)."""
    found: dict[str, list[str]] = {"coordinator": [], "worker": []}
    for role, address in _METRICS_ENDPOINT.findall(log_path.read_text(errors="replace")):
        found[role].append(address)
    if len(found["coordinator"]) == 1 and len(found["worker"]) == workers:
        return found
    return None


# ------------------------------------------------------------------ connecting


def members_ready(client, workers: int) -> bool:
    members = [w for w in client.workers() if w.rank >= 0]
    return (
        client.world_size == workers
        and len(members) == workers
        and all(w.state == "ready" for w in members)
    )


def connect_ready(address: str, workers: int, wait_ready: bool = True):
    """Connects; with ``wait_ready``, also waits until all ``workers`` are members
    and report ``ready`` (joined the process group), so tests measure the steady
    state. ``test_cli`` checks ops issued right after ``connect()`` separately."""
    import collectives

    client = collectives.connect(address, timeout=CONNECT_TIMEOUT_S)
    if not wait_ready:
        return client
    try:
        wait_until(
            lambda: members_ready(client, workers),
            CONNECT_TIMEOUT_S,
            f"{workers} ready workers at {address}",
        )
    except BaseException:
        client.close()
        raise
    return client
