"""Shared test machinery: real local clusters, polling with a deadline, and the
local torch oracle every collective is checked against.

The integration tests treat the service as a black box: they start
``python -m collectives_server local`` as a child process, talk to it only
through the public SDK (``import collectives``) or plain gRPC, and compare
every result with what torch computes locally on the same inputs.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = [
    "BITWISE_OPS",
    "REDUCE_OPS",
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


_LOG_RECORD_START = re.compile(r"^\d{4}-\d{2}-\d{2} ")


def internal_lines(log_path: Path) -> list[str]:
    """The lines of a daemon log that report an INTERNAL status or error, each with the
    traceback logged under it (the log is gone with a CI machine: the report keeps it)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    marks = ("INTERNAL", "internal error (id")
    found: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not any(m in line for m in marks):
            continue
        found.append(f"{log_path.name}: {line}")
        for follow in lines[i + 1 : i + 1 + 60]:
            if _LOG_RECORD_START.match(follow):
                break
            found.append(f"    {follow}")
    return found


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
