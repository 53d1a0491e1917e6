"""What every attack test checks after the attack, written once.

The rule for every attack: after each hostile input the daemon is alive and
healthy within 1 s, its memory is back to baseline (measured RSS), and every
tensor stored before the attack is intact. :class:`Aftermath` captures the
baseline (random sentinel tensors on every rank, each worker's RSS) before the
attack and asserts all three afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import wait_until

__all__ = ["Aftermath", "assert_serving", "rss_bytes"]

MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    """The resident set size of a local process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def assert_serving(address: str, within_s: float = 1.0, credentials=None, token: str = "") -> float:
    """The gRPC health service at ``address`` answers SERVING within ``within_s``.

    Returns how long it took. One call with that deadline, on a fresh channel,
    so a daemon whose threads are all held by an attacker fails it.
    """
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    start = time.monotonic()
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""),
            timeout=within_s,
            wait_for_ready=True,
            metadata=metadata,
        )
    finally:
        channel.close()
    took = time.monotonic() - start
    assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {reply}"
    return took


@dataclass
class Aftermath:
    """Baseline before an attack; :meth:`check` after it.

    ``cluster`` is a connected ``collectives.Cluster``. Sentinels are random
    tensors (a different one on every rank) under ``name``.
    """

    cluster: object
    name: str = "hostile/sentinel"
    shape: Sequence[int] = (257, 3)
    sentinels: list[torch.Tensor] = field(default_factory=list)
    baseline_rss: dict[int, int] = field(default_factory=dict)
    addresses: dict[int, str] = field(default_factory=dict)

    def capture(self) -> Aftermath:
        cluster = self.cluster
        gen = torch.Generator().manual_seed(int(time.time_ns()) & 0xFFFF_FFFF)
        members = sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)
        self.sentinels = [torch.randn(*self.shape, generator=gen) for _ in members]
        for w, t in zip(members, self.sentinels, strict=True):
            cluster.put(self.name, t, rank=w.rank)
            self.addresses[w.rank] = w.address
        # RSS after the sentinels are stored, so they are part of the baseline.
        for w in members:
            self.baseline_rss[w.pid] = rss_bytes(w.pid)
        return self

    def check(
        self,
        rss_slack_bytes: int = 64 * MiB,
        rss_deadline_s: float = 10.0,
        within_s: float = 1.0,
        credentials=None,
        token: str = "",
    ) -> None:
        """Healthy within ``within_s``; RSS back within slack; sentinels intact."""
        for address in self.addresses.values():
            assert_serving(address, within_s, credentials=credentials, token=token)
        for pid, before in self.baseline_rss.items():
            wait_until(
                lambda pid=pid, before=before: rss_bytes(pid) <= before + rss_slack_bytes,
                rss_deadline_s,
                f"worker pid {pid}: RSS back to its baseline {before / MiB:.0f} MiB "
                f"(+{rss_slack_bytes / MiB:.0f} MiB)",
            )
        # Each worker is found by its address: a loaded machine may have delayed a
        # heartbeat past the lease, and the cluster re-formed with other ranks.
        rank_now = {w.address: w.rank for w in self.cluster.workers() if w.rank >= 0}
        for rank, expected in enumerate(self.sentinels):
            address = self.addresses[rank]
            assert address in rank_now, f"worker {address} (rank {rank}) left the cluster"
            got = self.cluster.get(self.name, rank=rank_now[address])
            assert torch.equal(got, expected), f"sentinel on worker {address} changed"
