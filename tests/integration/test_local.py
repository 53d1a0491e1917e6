"""The local launcher: a coordinator and workers as children, supervised.

Real processes and real signals: a worker SIGKILLed must not take the launcher
down, SIGTERM must stop every child and exit 0, and a dead coordinator must make
the launcher stop its workers and exit non-zero. Waits follow the coordinator's
WatchCluster stream or a process exit, each under a deadline.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from launcher import LocalCluster as LauncherProcess

from collectives.v1 import coordinator_pb2 as pb
from collectives.v1 import coordinator_pb2_grpc as pb_grpc
from collectives_server.coordinator.daemon import CoordinatorConfig
from collectives_server.local import Child, LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAST = ["--heartbeat", "0.3", "--lease", "1.5", "--devices", "cpu"]


def watch_until(
    address: str, predicate: Callable[[pb.Cluster], bool], what: str, timeout_s: float = 60.0
) -> pb.Cluster:
    last = None
    with grpc.insecure_channel(address) as channel:
        stream = pb_grpc.CoordinatorStub(channel).WatchCluster(
            pb.WatchClusterRequest(), timeout=timeout_s
        )
        try:
            for last in stream:
                if predicate(last):
                    return last
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        finally:
            stream.cancel()
    raise AssertionError(f"timed out waiting for {what}; last cluster: {last}")


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(p) for p in (task / "children").read_text().split())
    return found


def descendants_of(pid: int) -> set[int]:
    """Every process below ``pid`` (the workers are the worker zygote's children)."""
    found, frontier = set(), {pid}
    while frontier:
        below = set().union(*(children_of(p) for p in frontier if Path(f"/proc/{p}").exists()))
        frontier = below - found
        found |= below
    return found


def the_coordinator_of(launcher_pid: int) -> int:
    """The launcher's coordinator (forked by its zygote, as its workers are)."""
    (pid,) = (
        p
        for p in descendants_of(launcher_pid)
        # A forked process's title is its command line (setproctitle), spaces and all.
        if b"collectives_server coordinator " in Path(f"/proc/{p}/cmdline").read_bytes()
    )
    return pid


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_worker_death_is_survived_and_sigterm_stops_everything(tmp_path: Path) -> None:
    launcher = LauncherProcess(2, FAST, tmp_path / "local.log", shared_zygote=False)
    launcher.start()
    try:
        assert launcher.address.startswith("127.0.0.1:")
        assert launcher.proc is not None
        ready = watch_until(
            launcher.address, lambda c: c.ready and c.world_size == 2, "a ready cluster of 2"
        )
        kids = descendants_of(launcher.proc.pid)
        # the coordinator, the worker zygote and the 2 workers it forked
        assert len(kids) == 4 and {w.pid for w in ready.workers} <= kids, kids
        victim = ready.workers[1]
        os.kill(victim.pid, signal.SIGKILL)
        watch_until(
            launcher.address,
            lambda c: any(
                w.worker_id == victim.worker_id and w.state == pb.WORKER_STATE_LOST
                for w in c.workers
            ),
            "the killed worker to be LOST",
        )
        assert launcher.proc.poll() is None, "a worker's death took the launcher down"
        assert launcher.stop() == 0, launcher.log_tail()
        assert all(gone(pid) for pid in kids), "the launcher left children behind"
    finally:
        launcher.stop()


def test_launcher_exits_nonzero_when_the_coordinator_dies(tmp_path: Path) -> None:
    launcher = LauncherProcess(1, FAST, tmp_path / "local.log", shared_zygote=False)
    launcher.start()
    try:
        assert launcher.proc is not None
        ready = watch_until(launcher.address, lambda c: c.ready, "a ready cluster of 1")
        worker_pid = ready.workers[0].pid
        coordinator_pid = the_coordinator_of(launcher.proc.pid)
        os.kill(coordinator_pid, signal.SIGKILL)
        assert launcher.proc.wait(timeout=30) == 1, launcher.log_tail()
        assert gone(worker_pid)
        assert "the coordinator killed by SIGKILL" in launcher.log_path.read_text()
    finally:
        launcher.stop()


def test_in_process_local_cluster() -> None:
    exited: list[Child] = []
    exit_seen = threading.Event()

    def on_exit(child: Child) -> None:
        exited.append(child)
        exit_seen.set()

    fast = CoordinatorConfig(min_workers=1, max_workers=1, heartbeat_s=0.3, lease_s=1.5)
    with LocalCluster(1, coordinator_config=fast, devices="cpu", on_exit=on_exit) as cluster:
        cluster_msg = cluster.wait_ready(timeout_s=60)
        assert cluster_msg.world_size == 1
        (worker_address,) = cluster.worker_addresses(timeout_s=10)
        assert cluster_msg.workers[0].address == worker_address
        assert len(cluster.worker_processes) == 1
        cluster.worker_processes[0].kill()
        assert exit_seen.wait(30)
        assert exited[0].name == "worker 0" and exited[0].returncode == -signal.SIGKILL
    assert cluster.coordinator_process is not None
    assert cluster.coordinator_process.returncode == 0
