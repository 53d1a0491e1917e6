"""Fixtures shared by every test: seeds, unique names, and real local clusters.

Every cluster is started by the tests' one launcher (tests/launcher.py), with
short heartbeats and leases so failure detection is quick. ``cluster2`` and
``cluster3`` are shared by the integration tests (every test uses its own
tensor names) and stop when this process has run the last of them;
``local_cluster(n, *flags)`` shares a cluster among the tests of one module
asking for the same flags and stops it after the module; tests that kill,
stop or reconfigure a daemon get a cluster of their own from ``fresh_cluster``.
"""

from __future__ import annotations

import os
import secrets
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

# The suite runs on CPU (gloo) whatever the machine has: this process and every
# daemon it starts see no GPU, so `--devices auto` on a host with GPUs does not
# silently switch the tests to NCCL. COLLECTIVES_TEST_GPU=1 leaves the GPUs
# visible; `make gpu-check` is the GPU run.
if os.environ.get("COLLECTIVES_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch
from helpers import CLUSTER_FLAGS, connect_ready, internal_lines, worker_token_file
from launcher import LocalCluster, close_zygote, set_log_dir
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


# Directories run in this order without pytest-xdist. Under it (--dist loadfile) each
# process takes whole files, the files with the most tests first, so a process may
# leave the integration files for another directory's and come back: the shared
# clusters stop when it leaves them and start again if it returns (their fixtures
# are per module).
_DIRECTORY_ORDER = ("fault", "browser", "integration", "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        parts = item.path.relative_to(here).parts if item.path.is_relative_to(here) else ()
        top = parts[0] if len(parts) > 1 else ""
        return _DIRECTORY_ORDER.index(top) if top in _DIRECTORY_ORDER else len(_DIRECTORY_ORDER)

    items.sort(key=rank)  # stable: each directory keeps its own order


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
    assert not found, "daemons logged INTERNAL:\n" + "\n".join(found[:120])


class ClusterPool:
    """Live local clusters keyed by their flags: the first test asking for (workers,
    flags) starts one, every later test asking the same reuses it, and ``stop()``
    ends them all (with their shared clients)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._clusters: dict[tuple[int, tuple[str, ...]], LocalCluster] = {}
        self._clients: dict[tuple[int, tuple[str, ...]], object] = {}
        self.stopped: list[LocalCluster] = []

    def address(self, workers: int, *flags: str) -> str:
        key = (workers, flags)
        cluster = self._clusters.get(key)
        if cluster is None:
            cluster = self._clusters[key] = _start(self._directory, workers, flags)
        return cluster.address

    def client(self, workers: int, *flags: str):
        """One connected client of that cluster, shared, once all its workers are ready."""
        key = (workers, flags)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = connect_ready(self.address(workers, *flags), workers)
        return client

    def stop(self) -> None:
        for client in self._clients.values():
            client.close()  # type: ignore[attr-defined]
        for cluster in reversed(self._clusters.values()):
            cluster.stop()
        self.stopped.extend(self._clusters.values())
        self._clusters.clear()
        self._clients.clear()


@pytest.fixture(scope="session", autouse=True)
def _daemon_logs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every daemon's log lives in this session's temporary directory."""
    set_log_dir(tmp_path_factory.getbasetemp() / "daemons")


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    """``local_cluster(n, *extra_flags)`` → the coordinator address of a cluster of n
    workers with those flags, shared by every test of this module asking the same
    and stopped after the module's last test."""
    pool = ClusterPool(tmp_path_factory.mktemp("clusters"))
    yield pool.address
    pool.stop()
    _assert_no_internal(pool.stopped)


# The shared clusters let load_model(factory=...) use the factories shipped with the server,
MODEL_ZOO = ("--allow-factory", "collectives_server.model_zoo")
# and keep their members whatever the machine's load: no test kills one of theirs (those
# tests take a cluster of their own), so a lease of seconds would only evict a live worker
# whose heartbeat a loaded machine delayed, and move the cluster under a running test.
# With a lease that long, a beat a second is plenty: each beat costs the worker and the
# coordinator CPU, and these clusters live through most of the run.
SHARED_FLAGS = (*MODEL_ZOO, "--lease", "30", "--heartbeat", "1.0")
# COLLECTIVES_TEST_ROADS=grpc starts them without their fast roads (no bulk port, hence
# no call lanes: every call and every tensor takes gRPC). `make test-roads` runs the
# behaviour tests that way, so their answers are checked on both roads (docs/design.md,
# "Two roads for one behaviour").
ROADS = os.environ.get("COLLECTIVES_TEST_ROADS", "fast")
if ROADS not in ("fast", "grpc"):
    raise pytest.UsageError(f"COLLECTIVES_TEST_ROADS={ROADS!r}: use fast or grpc")
if ROADS == "grpc":
    SHARED_FLAGS = (*SHARED_FLAGS, "--no-bulk")
# Where the tests that share cluster2 / cluster3 live: those clusters stop once this
# process has run its last test there (see pytest_runtest_teardown).
SHARED_CLUSTER_TESTS = Path(__file__).parent / "integration"
_SHARED = pytest.StashKey[ClusterPool]()


@pytest.fixture(scope="session")
def shared_clusters(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterPool]:
    """The clusters every integration test may share (``cluster2``, ``cluster3``)."""
    pool = ClusterPool(tmp_path_factory.mktemp("shared-clusters"))
    request.config.stash[_SHARED] = pool
    yield pool
    pool.stop()
    _assert_no_internal(pool.stopped)


@pytest.hookimpl(trylast=True)  # after the item's fixtures (a module's own) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The shared clusters stop as soon as this process leaves the tests that use them
    (tests run directory by directory; under xdist each process gets whole files in
    collection order), instead of idling through the rest of the session. Last among
    the teardown hooks: a module fixture's teardown may still call the cluster."""
    pool = item.config.stash.get(_SHARED, None)
    if pool is None or not item.path.is_relative_to(SHARED_CLUSTER_TESTS):
        return
    if nextitem is None or not nextitem.path.is_relative_to(SHARED_CLUSTER_TESTS):
        pool.stop()  # their logs are checked when the session's fixture ends


# Per module, not per session: a process that left the integration files stopped
# them (pytest_runtest_teardown), and its next integration module starts them again.
@pytest.fixture(scope="module")
def cluster2_address(shared_clusters: ClusterPool) -> str:
    return shared_clusters.address(2, *SHARED_FLAGS)


@pytest.fixture(scope="module")
def cluster3_address(shared_clusters: ClusterPool) -> str:
    return shared_clusters.address(3, *SHARED_FLAGS)


@pytest.fixture(scope="module")
def cluster2(shared_clusters: ClusterPool, cluster2_address: str):
    """A connected ``collectives.Cluster`` of 2 workers, shared across modules."""
    return shared_clusters.client(2, *SHARED_FLAGS)


@pytest.fixture(scope="module")
def cluster3(shared_clusters: ClusterPool, cluster3_address: str):
    """A connected ``collectives.Cluster`` of 3 workers, shared across modules."""
    return shared_clusters.client(3, *SHARED_FLAGS)


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


@pytest.fixture(scope="session", autouse=True)
def _worker_zygote() -> Iterator[None]:
    """This process's worker zygote (tests/launcher.py, started when first needed),
    shared with the ``local`` launchers it starts; it ends after every fixture that
    started workers from it, before the run's leftover check would find it."""
    yield
    close_zygote()
