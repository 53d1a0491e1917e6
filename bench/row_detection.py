"""Failure detection: a killed worker seen, and the cluster re-formed, without the lease.

A local cluster of 2 members and 1 live spare (``--spares 1``, ``--lease 5``):
each round SIGKILLs a member and times, from the kill, as the coordinator's
``WatchCluster`` stream reports it:

- **re-formed**: the next generation sealed with the spare in the lost rank (the
  crash seen: its heartbeat stream closed and its port refuses connections);
- **ready**: every member of it joined its process group (collectives run again).

The killed slot is started again (``--max-restarts``) and waits as the next
spare before the next round. The anchor is the lease: what detection by lease
alone takes at the least (a frozen or partitioned worker is still found that
way). p50 and p99 over the rounds.
"""

from __future__ import annotations

import os
import signal
import time

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc

from .core import BenchContext, Row, Stat, local_cluster, stat_of

NAME = "detection"
GROUP = "7b failure detection"
LEASE_S = 5.0
_WATCH_TIMEOUT_S = 60.0


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
    return [
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
