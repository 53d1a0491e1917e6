"""What the coordinator keeps per worker, and the small pure pieces of the membership
decision that do not need the whole registry: a worker's row in the Cluster message,
the lease heap, the status text and registration checks (``membership.py`` holds
the decisions themselves)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from collectives_server.coordinator.vocabulary import InvalidRequestError, WorkerState, WorkerView

__all__ = [
    "WorkerRecord",
    "LeaseHeap",
    "worker_row",
    "plural",
    "status_text",
    "validate_registration",
]

# How many LOST workers stay listed, and for how long, so dashboards can show them.
LOST_KEEP_COUNT = 16
LOST_KEEP_S = 600.0
# The lease heap keeps one entry per heartbeat until it is due; it is rebuilt when it
# holds more than this many entries per worker (a worker beating far faster than usual).
LEASE_ENTRIES_PER_WORKER = 16


@dataclass
class WorkerRecord:
    worker_id: str
    address: str
    hostname: str
    pid: int
    devices: tuple[str, ...]
    backend: str
    version: str
    order: int
    registered_at: float
    last_heartbeat: float
    # The rendezvous store it hosts (Register refuses 0; 0 only in a membership
    # driven directly, without gRPC).
    store_port: int = 0
    joined_generation: int = 0
    busy: bool = False
    lost_at: float | None = None
    # Drained (Membership.drain): never a candidate again; it leaves once its handoff ends.
    drained: bool = False
    status: Any = None
    # Key of the status last published (bumped the version), and when.
    status_key: bytes | None = None
    status_published_at: float = float("-inf")

    @property
    def lost(self) -> bool:
        return self.lost_at is not None

    def take_status(
        self, now: float, status: Any, key: bytes | None, refresh_s: float, force: bool
    ) -> tuple[bool, str]:
        """Stores a reported status; whether to publish it now (its key changed, the
        last publication is ``refresh_s`` old, or ``force``), and a note for the reason."""
        self.status = status
        stale = now - self.status_published_at >= refresh_s
        if key == self.status_key and not stale and not force:
            return False, ""
        note = ", status changed" if key != self.status_key else ""
        self.status_key = key
        self.status_published_at = now
        return True, note


def worker_row(
    w: WorkerRecord, rank: int, now: float, generation: int, full: bool = False
) -> WorkerView:
    """``w``'s row in the Cluster message (rank -1: not a member; ``full``: the formed
    generation has no room, so a live non-member is a spare)."""
    if w.lost:
        state = WorkerState.LOST
    elif w.drained:
        state = WorkerState.DRAINING
    elif rank < 0 and full:
        state = WorkerState.SPARE
    elif rank < 0 or w.joined_generation != generation:
        state = WorkerState.JOINING
    else:
        state = WorkerState.BUSY if w.busy else WorkerState.READY
    return WorkerView(
        worker_id=w.worker_id,
        rank=rank,
        address=w.address,
        hostname=w.hostname,
        pid=w.pid,
        state=state,
        devices=w.devices,
        joined_generation=w.joined_generation,
        last_heartbeat_age_s=max(0.0, now - w.last_heartbeat),
        backend=w.backend,
        uptime_s=max(0.0, now - w.registered_at),
        version=w.version,
        status=w.status,
        store_port=w.store_port,
    )


class LeaseHeap:
    """Leases ordered by last heartbeat: (last heartbeat, order, worker id), one entry per
    renewal; an entry whose time is no longer its worker's last heartbeat is stale."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, int, str]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def renew(self, w: WorkerRecord, now: float, workers: dict[str, WorkerRecord]) -> None:
        """Sets the worker's last heartbeat and files its lease in the heap."""
        w.last_heartbeat = now
        heapq.heappush(self.entries, (now, w.order, w.worker_id))
        if len(self.entries) > LEASE_ENTRIES_PER_WORKER * len(workers) + 1024:
            self.entries = [(x.last_heartbeat, x.order, x.worker_id) for x in workers.values()]
            heapq.heapify(self.entries)

    def due(
        self, now: float, lease_s: float, workers: dict[str, WorkerRecord]
    ) -> list[WorkerRecord]:
        """Live workers whose lease ran out (strictly more than lease_s ago), in
        registration order. Pops only the entries that are due: O(1) when none is."""
        due: dict[str, WorkerRecord] = {}  # a renewal at the same time can have two entries
        while self.entries and now - self.entries[0][0] > lease_s:
            beat, _, worker_id = heapq.heappop(self.entries)
            w = workers.get(worker_id)
            if w is not None and not w.lost and w.last_heartbeat == beat:
                due[worker_id] = w
        return sorted(due.values(), key=lambda w: w.order)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def status_text(
    *,
    formed: bool,
    generation: int,
    live: int,
    members: int,
    joining: int,
    min_workers: int,
    max_workers: int,
) -> str:
    """The one-line status of the cluster shown by ``collectives status``."""
    if not formed:
        if live < min_workers:
            more = plural(min_workers - live, "more worker")
            return f"waiting for {more} ({live} live, min {min_workers})"
        return (
            f"sealing generation {generation + 1} after the join window "
            f"({live} live, min {min_workers}, max {max_workers})"
        )
    if joining:
        text = (
            f"generation {generation} sealed with {plural(members, 'worker')}; "
            f"{joining} joining its process group"
        )
    else:
        text = f"generation {generation} ready with {plural(members, 'worker')}"
    waiting = live - members
    if waiting:
        text += f"; {waiting} waiting to join (max {max_workers})"
    return text


def validate_registration(address: str, devices: tuple[str, ...]) -> None:
    host, sep, port = address.rpartition(":")
    if not address or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError(
            f"address {address!r} is not HOST:PORT; send the host:port your gRPC server "
            "listens on, e.g. '10.0.0.5:50052'"
        )
    if not devices or any(not d.strip() for d in devices):
        raise InvalidRequestError(
            f"devices {list(devices)!r} must be a non-empty list of device names "
            "such as 'cpu' or 'cuda:0'"
        )


def unknown_message(w: WorkerRecord | None, worker_id: str, lease_s: float) -> str:
    """Why a heartbeat or leave from ``worker_id`` is refused."""
    if w is not None and w.lost:
        return (
            f"worker {worker_id!r} was declared lost (no heartbeat within the "
            f"{lease_s:g} s lease); register again"
        )
    return (
        f"unknown worker_id {worker_id!r} (the coordinator restarted, or the worker "
        "expired long ago); register again"
    )


def prune_lost(workers: dict[str, WorkerRecord], now: float) -> bool:
    """Drops LOST workers older than LOST_KEEP_S, and the oldest beyond LOST_KEEP_COUNT;
    whether any went."""
    lost = sorted((w for w in workers.values() if w.lost), key=lambda w: w.lost_at or 0.0)
    drop = [w for w in lost if now - (w.lost_at or now) > LOST_KEEP_S]
    keep = [w for w in lost if w not in drop]
    drop += keep[: max(0, len(keep) - LOST_KEEP_COUNT)]
    for w in drop:
        del workers[w.worker_id]
    return bool(drop)


def check_limits(min_workers: int, max_workers: int, lease_s: float, join_window_s: float) -> None:
    """Raises ValueError for membership bounds that cannot work."""
    if min_workers < 1:
        raise ValueError(f"min_workers must be >= 1, got {min_workers}")
    if max_workers < min_workers:
        raise ValueError(f"max_workers ({max_workers}) must be >= min_workers ({min_workers})")
    if lease_s <= 0 or join_window_s < 0:
        raise ValueError("lease_s must be > 0 and join_window_s >= 0")
