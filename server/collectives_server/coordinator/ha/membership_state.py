"""The membership as a JSON document, so another coordinator can take over from it.

With an etcd store (:mod:`.etcd_store`) the leading coordinator writes this
document after every change (fenced by its leadership) and standbys read it: it
holds everything :class:`~.membership.Membership` decides from (workers, their
order and id prefix, the generation and its members, history, counters) and the
lease secrets, so workers keep their ids and secrets across a failover.

Times on the membership's monotonic clock travel as Unix times. Restoring gives
every live worker a fresh lease: a new leader cannot know when it last heard
from them, and declaring them all lost would break a healthy generation.

Restoring decides nothing: the restored membership is exactly the recorded one
(a standby serves it as it is; a new leader then calls ``Membership.resume``,
whose decision it records before anyone sees it). The join window goes on from
the last registration the document records, so a takeover does not seal early.
The document carries each generation's membership digest, and a document whose
digest does not match its member list is refused as unreadable.

This module reads and sets :class:`~.membership.Membership`'s private state on
purpose: it is that class's persistence, kept apart so the rules stay in one
file of readable size.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
from typing import Any

from collectives.v1 import status_pb2
from collectives_server.coordinator.admission import LeaseBook
from collectives_server.coordinator.membership import Membership
from collectives_server.coordinator.vocabulary import DrainReport, Handoff, SealedGeneration
from collectives_server.coordinator.worker_records import WorkerRecord
from collectives_server.membership_digest import membership_digest

__all__ = ["FORMAT", "export_state", "restore_state"]

FORMAT = 1


def _status_bytes(status: Any) -> str | None:
    if status is None or not hasattr(status, "SerializeToString"):
        return None
    return base64.b64encode(status.SerializeToString()).decode()


def _worker(w: WorkerRecord, now: float, unix_now: float) -> dict[str, Any]:
    return {
        "id": w.worker_id,
        "address": w.address,
        "hostname": w.hostname,
        "pid": w.pid,
        "devices": list(w.devices),
        "backend": w.backend,
        "version": w.version,
        "order": w.order,
        "registered_unix": unix_now - (now - w.registered_at),
        "joined_generation": w.joined_generation,
        "busy": w.busy,
        "lost_unix": None if w.lost_at is None else unix_now - (now - w.lost_at),
        "store_port": w.store_port,
        "drained": w.drained,
        "status": _status_bytes(w.status),
    }


_HANDOFF_TIMES = ("started_at", "deadline", "prepare_by", "sealed_at")
_HANDOFF_LISTS = ("planned", "prepared")


def _handoff(h: Handoff, now: float, unix_now: float) -> dict[str, Any]:
    row = dataclasses.asdict(h)
    for key in _HANDOFF_TIMES:
        if row[key] is not None:
            row[key] = unix_now - (now - row[key])
    return row


def _drain(r: DrainReport, now: float, unix_now: float) -> dict[str, Any]:
    row = dataclasses.asdict(r)
    row["lost"] = list(r.lost)
    row["finished_at"] = unix_now - (now - r.finished_at)
    return row


def export_state(
    m: Membership, leases: LeaseBook, *, now: float, unix_now: float
) -> dict[str, Any]:
    """Everything a successor needs, as JSON-ready data."""
    return {
        "format": FORMAT,
        "id_prefix": m._id_prefix,
        "next_order": m._next_order,
        "generation": m._generation,
        "members": list(m._members),
        "formed": m._formed,
        "membership_digest": m.membership_digest,
        "last_registration_unix": (
            None if m._last_registration is None else unix_now - (now - m._last_registration)
        ),
        "version": m._version,
        "events": dict(m.events),
        "workers": [_worker(w, now, unix_now) for w in m._workers.values()],
        "history": [
            {
                "generation": r.generation,
                "sealed_unix": unix_now - (now - r.sealed_at),
                "world_size": r.world_size,
                "members": list(r.members),
                "reason": r.reason,
                "sealed_by": r.sealed_by,
                "membership_digest": r.membership_digest,
                "carried_over": r.carried_over,
                "formed_ahead": r.formed_ahead,
            }
            for r in m._history
        ],
        "handoff": None if m._handoff is None else _handoff(m._handoff, now, unix_now),
        "drains": [_drain(r, now, unix_now) for r in m._drains],
        "drains_completed": m.drains_completed,
        "drain_bytes_total": m.drain_bytes_total,
        "leases": leases.export(),
    }


def restore_state(
    data: dict[str, Any],
    m: Membership,
    leases: LeaseBook,
    *,
    now: float,
    unix_now: float,
) -> None:
    """Loads ``data`` into a fresh ``m`` (built with the same limits) and ``leases``.

    Decides nothing: ``m`` holds exactly the recorded membership, at the stored
    version. Raises ValueError for a document of another format, or one whose
    membership digest does not name its members.
    """
    if data.get("format") != FORMAT:
        raise ValueError(f"membership state of format {data.get('format')!r}; expected {FORMAT}")
    members = list(data["members"])
    formed = bool(data["formed"])
    recorded = data.get("membership_digest")
    if recorded is not None and recorded != (membership_digest(members) if formed else ""):
        raise ValueError(
            f"membership document names generation {data['generation']} with digest "
            f"{recorded!r}, but its members {members} have digest {membership_digest(members)!r}"
        )

    def mono(unix_time: float) -> float:
        return now - max(0.0, unix_now - unix_time)

    m._id_prefix = data["id_prefix"]
    m._next_order = int(data["next_order"])
    m._generation = int(data["generation"])
    m._members = members
    m._formed = formed
    m._version = int(data["version"])
    m.events = collections.Counter({k: int(v) for k, v in data["events"].items()})
    m._workers = {}
    m._live_n = 0
    m._leases.entries = []
    for row in data["workers"]:
        status = None
        if row.get("status"):
            status = status_pb2.WorkerStatus.FromString(base64.b64decode(row["status"]))
        w = WorkerRecord(
            worker_id=row["id"],
            address=row["address"],
            hostname=row["hostname"],
            pid=int(row["pid"]),
            devices=tuple(row["devices"]),
            backend=row["backend"],
            version=row["version"],
            order=int(row["order"]),
            registered_at=mono(float(row["registered_unix"])),
            last_heartbeat=now,
            joined_generation=int(row["joined_generation"]),
            busy=bool(row["busy"]),
            lost_at=None if row["lost_unix"] is None else mono(float(row["lost_unix"])),
            status=status,
            store_port=int(row.get("store_port", 0)),
            drained=bool(row.get("drained", False)),
        )
        m._workers[w.worker_id] = w
        if not w.lost:
            m._live_n += 1
            m._leases.renew(w, now, m._workers)
    m._history.clear()
    for r in data["history"]:
        m._history.append(
            SealedGeneration(
                generation=int(r["generation"]),
                sealed_at=mono(float(r["sealed_unix"])),
                world_size=int(r["world_size"]),
                members=tuple(r["members"]),
                reason=r["reason"],
                sealed_by=r.get("sealed_by", ""),
                membership_digest=r.get("membership_digest", ""),
                carried_over=bool(r.get("carried_over", False)),
                formed_ahead=str(r.get("formed_ahead", "")),
            )
        )
    handoff = data.get("handoff")
    m._handoff = None
    if handoff is not None:
        m._handoff = Handoff(
            **{
                k: tuple(v) if k in _HANDOFF_LISTS else v
                for k, v in handoff.items()
                if k not in _HANDOFF_TIMES
            },
            started_at=mono(float(handoff["started_at"])),
            # The new leader gives a pending handoff the rest of its time, from now on.
            deadline=now + max(0.0, float(handoff["deadline"]) - unix_now),
            prepare_by=now + max(0.0, float(handoff.get("prepare_by", unix_now)) - unix_now),
            # (A sealed handoff recorded without its seal's time was sealed at its start.)
            sealed_at=(
                mono(float(handoff["sealed_at"]))
                if handoff.get("sealed_at") is not None
                else None
                if handoff.get("preparing")
                else mono(float(handoff["started_at"]))
            ),
        )
    m._drains.clear()
    for r in data.get("drains", []):
        fields = {k: v for k, v in r.items() if k != "finished_at"}
        fields["lost"] = tuple(fields.get("lost", ()))
        m._drains.append(DrainReport(**fields, finished_at=mono(float(r["finished_at"]))))
    m.drains_completed = int(data.get("drains_completed", 0))
    m.drain_bytes_total = int(data.get("drain_bytes_total", 0))
    last = data.get("last_registration_unix")
    m._last_registration = None if last is None else mono(float(last))
    leases.restore(data.get("leases", {}))
    m._settle(now)
    m._update_status()
