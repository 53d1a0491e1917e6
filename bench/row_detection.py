"""Failure detection: a killed worker seen, and the cluster re-formed, without the lease.

A local cluster of 2 members and 1 live spare (``--spares 1``, ``--lease 5``):
each round SIGKILLs a member and times, from the kill, as the coordinator's
``WatchCluster`` stream reports it:

- **re-formed**: the next generation sealed with the spare in the lost rank (the
  crash seen: its heartbeat stream closed and its port refuses connections);
- **ready**: every member of it joined its process group (collectives run again).

The killed slot is started again (``--max-restarts``) and waits as the next
spare before the next round. The anchor is the lease: what detection by lease
alone takes at the least. p50 and p99 over the rounds.

A frozen worker (SIGSTOP: its process and connections stay, it just stops
answering) is found by the lease alone, so a second cluster runs with a lease
of 2 s (heartbeats every 0.5 s): each round stops a member and times the seal
of the next generation (target: within the lease + 1 s), then lets it go on
(SIGCONT: it finds itself lost and registers again as the next spare). Last,
with every core of the host busy (one spinning process per core), that
cluster runs idle for ``SATURATION_S`` seconds and counts the workers declared
lost: a live worker must never be.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc

from .core import BenchContext, Row, Stat, local_cluster, stat_of

NAME = "detection"
GROUP = "7b failure detection"
LEASE_S = 5.0
FREEZE_LEASE_S = 2.0
SATURATION_S = 300.0
_WATCH_TIMEOUT_S = 60.0
_SPIN = "while True: pass"


def run(ctx: BenchContext) -> list[Row]:
    rounds = 3 if ctx.quick else 20
    flags = ("--spares", "1", "--max-restarts", str(rounds + 1), "--devices", "cpu")
    flags += ("--lease", f"{LEASE_S:g}", "--heartbeat", "1")
    reformed: list[float] = []
    ready: list[float] = []
    with (
        local_cluster(2, *flags) as address,
        grpc.insecure_channel(address) as channel,
    ):
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for _ in range(rounds):
            cluster = _watch_until(stub, _full, "2 ready members and a spare")
            victim = next(w for w in cluster.workers if w.rank == 1)
            spare = next(w for w in cluster.workers if w.rank < 0 and _is_spare(w))
            killed_at = time.perf_counter()
            os.kill(victim.pid, signal.SIGKILL)
            stream = stub.WatchCluster(
                coordinator_pb2.WatchClusterRequest(after_version=cluster.version),
                timeout=_WATCH_TIMEOUT_S,
            )
            sealed_at = 0.0
            try:
                for msg in stream:
                    members = {w.worker_id for w in msg.workers if w.rank >= 0}
                    if not sealed_at and msg.generation > cluster.generation:
                        if spare.worker_id not in members:
                            raise AssertionError(f"generation {msg.generation}: no spare in it")
                        sealed_at = time.perf_counter()
                    if sealed_at and msg.ready and msg.world_size == 2:
                        ready.append(time.perf_counter() - killed_at)
                        reformed.append(sealed_at - killed_at)
                        break
            finally:
                stream.cancel()
    lease = Stat(LEASE_S, LEASE_S, LEASE_S, "s", 1, LEASE_S)
    note = f"{rounds} SIGKILLs of a member, a spare live each time; lease {LEASE_S:g} s"
    frozen, evicted, saturated_s = _freezes_and_saturation(ctx)
    short = Stat(FREEZE_LEASE_S, FREEZE_LEASE_S, FREEZE_LEASE_S, "s", 1, FREEZE_LEASE_S)
    cores = os.cpu_count() or 1
    return [
        Row(
            group=GROUP,
            what="a member frozen (SIGSTOP) -> next generation sealed with the spare",
            service=stat_of(frozen, "s"),
            anchor_name=f"the heartbeat lease ({FREEZE_LEASE_S:g} s)",
            anchor=short,
            target=f"<= {(FREEZE_LEASE_S + 1) / FREEZE_LEASE_S:g}",
            note=f"{len(frozen)} SIGSTOPs; lease {FREEZE_LEASE_S:g} s, heartbeat 0.5 s",
        ),
        Row(
            group=GROUP,
            what=f"every core busy ({cores} spinning processes), idle cluster: workers lost",
            service=Stat(evicted, evicted, evicted, "lost", 1, evicted),
            anchor_name="none may be",
            anchor=Stat(0, 0, 0, "lost", 1, 0),
            note=f"{saturated_s:.0f} s saturated; lease {FREEZE_LEASE_S:g} s, heartbeat 0.5 s",
        ),
        Row(
            group=GROUP,
            what="a member killed -> next generation sealed with the spare in its rank",
            service=stat_of(reformed, "s"),
            anchor_name=f"the heartbeat lease ({LEASE_S:g} s)",
            anchor=lease,
            target="<= 0.2",
            note=note,
        ),
        Row(
            group=GROUP,
            what="a member killed -> every member of the new generation joined (ready)",
            service=stat_of(ready, "s"),
            anchor_name=f"the heartbeat lease ({LEASE_S:g} s)",
            anchor=lease,
            note=note,
        ),
    ]


def _freezes_and_saturation(ctx: BenchContext) -> tuple[list[float], int, float]:
    """(seconds from each SIGSTOP to the seal, workers lost while saturated, seconds)."""
    rounds = 2 if ctx.quick else 10
    saturation_s = 20.0 if ctx.quick else SATURATION_S
    flags = ("--spares", "1", "--max-restarts", "0", "--devices", "cpu")
    flags += ("--lease", f"{FREEZE_LEASE_S:g}", "--heartbeat", "0.5")
    frozen: list[float] = []
    with (
        local_cluster(2, *flags) as address,
        grpc.insecure_channel(address) as channel,
    ):
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for _ in range(rounds):
            cluster = _watch_until(stub, _full, "2 ready members and a spare")
            victim = next(w for w in cluster.workers if w.rank == 1)
            stopped_at = time.perf_counter()
            os.kill(victim.pid, signal.SIGSTOP)
            try:
                _watch_until(
                    stub,
                    lambda msg, g=cluster.generation: msg.generation > g,
                    "the frozen member replaced",
                )
                frozen.append(time.perf_counter() - stopped_at)
            finally:
                os.kill(victim.pid, signal.SIGCONT)  # it registers again: the next spare
        before = _watch_until(stub, _full, "2 ready members and a spare")
        spinners = [
            subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(os.cpu_count() or 1)
        ]
        try:
            stream = stub.WatchCluster(
                coordinator_pb2.WatchClusterRequest(after_version=before.version),
                timeout=saturation_s,
            )
            # Listed as lost already: the frozen members of the rounds above.
            lost_before = {
                w.worker_id for w in before.workers if w.state == coordinator_pb2.WORKER_STATE_LOST
            }
            lost: set[str] = set()
            began = time.perf_counter()
            try:
                for msg in stream:
                    lost |= {
                        w.worker_id
                        for w in msg.workers
                        if w.state == coordinator_pb2.WORKER_STATE_LOST
                    }
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            saturated = time.perf_counter() - began
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    return frozen, len(lost - lost_before), saturated


def _is_spare(w: coordinator_pb2.WorkerInfo) -> bool:
    return w.state == coordinator_pb2.WORKER_STATE_SPARE


def _full(msg: coordinator_pb2.Cluster) -> bool:
    members = [w for w in msg.workers if w.rank >= 0]
    return msg.ready and len(members) == 2 and sum(_is_spare(w) for w in msg.workers) == 1


def _watch_until(stub, predicate, what: str) -> coordinator_pb2.Cluster:
    stream = stub.WatchCluster(coordinator_pb2.WatchClusterRequest(), timeout=_WATCH_TIMEOUT_S)
    try:
        for msg in stream:
            if predicate(msg):
                return msg
    finally:
        stream.cancel()
    raise AssertionError(f"the cluster never showed {what}")
