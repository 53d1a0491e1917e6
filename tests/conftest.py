"""Fixtures shared by every test: seeds, unique names, and real local clusters.

Clusters are started with short heartbeats and leases so failure detection is
quick, and shared per session (``cluster2``, ``cluster3``) because every test
uses its own tensor names; tests that kill workers get their own cluster from
``fresh_cluster``.
"""

from __future__ import annotations

import os
import secrets
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    CLUSTER_FLAGS,
    LocalCluster,
    connect_ready,
    internal_lines,
    worker_token_file,
)
from skip_groups import skip_summary

# Random inputs differ per run; set COLLECTIVES_TEST_SEED to replay a run.
SESSION_SEED = int(os.environ.get("COLLECTIVES_TEST_SEED", secrets.randbits(31)))


def pytest_report_header(config: pytest.Config) -> str:
    return f"collectives test seed: COLLECTIVES_TEST_SEED={SESSION_SEED}"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config):
    """Ends the run with every group of skipped tests and the command that installs
    what it lacks, so a local run that skipped the browser or etcd suites says so.
    A wrapper around pytest's own summary, so these lines come after its list."""
    result = yield
    reasons = [_skip_reason(r) for r in terminalreporter.stats.get("skipped", [])]
    lines = skip_summary(reasons)
    if lines:
        terminalreporter.write_sep("=", "skipped groups (CI=true fails them instead)", yellow=True)
        for line in lines:
            terminalreporter.write_line(line, yellow=True, bold=True)
    return result


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A per-test seed: different for every test and run, replayable from the header."""
    return (SESSION_SEED ^ zlib.crc32(request.node.nodeid.encode())) & 0x7FFFFFFF


@pytest.fixture
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def uname(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """``uname("x")`` → a tensor name no other test uses (clusters are shared)."""
    prefix = f"t{uuid.uuid4().hex[:10]}"

    def make(tag: str = "x") -> str:
        return f"{prefix}/{tag}/{uuid.uuid4().hex[:6]}"

    return make


def _start(tmp_dir: Path, workers: int, extra_args: tuple[str, ...]) -> LocalCluster:
    log = tmp_dir / f"cluster{workers}-{uuid.uuid4().hex[:6]}.log"
    if not any(a.startswith("--worker-token-file") for a in extra_args):
        extra_args = (f"--worker-token-file={worker_token_file(tmp_dir)}", *extra_args)
    cluster = LocalCluster(workers, (*CLUSTER_FLAGS, *extra_args), log)
    cluster.start()
    return cluster


def _assert_no_internal(clusters: list[LocalCluster]) -> None:
    """INTERNAL means a bug of ours: no daemon of a test cluster may log one, whatever
    the tests sent it (hostile input, cancelled calls, expired deadlines)."""
    found = [line for cluster in clusters for line in internal_lines(cluster.log_path)]
    assert not found, "daemons logged INTERNAL:\n" + "\n".join(found[:20])


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    """``local_cluster(n, *extra_flags)`` starts a cluster of n workers for the
    rest of the session and returns its coordinator address."""
    started: list[LocalCluster] = []
    tmp_dir = tmp_path_factory.mktemp("clusters")

    def start(workers: int, *extra_args: str) -> str:
        cluster = _start(tmp_dir, workers, extra_args)
        started.append(cluster)
        return cluster.address

    yield start
    for cluster in reversed(started):
        cluster.stop()
    _assert_no_internal(started)


# The shared clusters let load_model(factory=...) use the factories shipped with the server.
MODEL_ZOO = ("--allow-factory", "collectives_server.model_zoo")


@pytest.fixture(scope="session")
def cluster2_address(local_cluster) -> str:
    return local_cluster(2, *MODEL_ZOO)


@pytest.fixture(scope="session")
def cluster3_address(local_cluster) -> str:
    return local_cluster(3, *MODEL_ZOO)


@pytest.fixture(scope="session")
def cluster2(cluster2_address: str) -> Iterator:
    """A connected ``collectives.Cluster`` of 2 workers, shared by the session."""
    with connect_ready(cluster2_address, 2) as client:
        yield client


@pytest.fixture(scope="session")
def cluster3(cluster3_address: str) -> Iterator:
    """A connected ``collectives.Cluster`` of 3 workers, shared by the session."""
    with connect_ready(cluster3_address, 3) as client:
        yield client


@pytest.fixture(params=[2, 3], ids=["ws2", "ws3"])
def cluster(request: pytest.FixtureRequest):
    """Each test using it runs once on 2 workers and once on 3 (odd sizes matter)."""
    return request.getfixturevalue(f"cluster{request.param}")


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[Callable[..., tuple[LocalCluster, object]]]:
    """``fresh_cluster(n, *extra_flags)`` → (LocalCluster, connected client) owned by
    this test alone and stopped after it: for tests that kill workers."""
    owned: list[tuple[LocalCluster, object]] = []

    def start(workers: int, *extra_args: str, wait_ready: bool = True):
        local = _start(tmp_path, workers, extra_args)
        owned.append((local, None))
        client = connect_ready(local.address, workers, wait_ready)
        owned[-1] = (local, client)
        return local, client

    yield start
    for local, client in reversed(owned):
        if client is not None:
            client.close()
        local.stop()
    _assert_no_internal([local for local, _ in owned])
