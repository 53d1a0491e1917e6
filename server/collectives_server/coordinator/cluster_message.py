"""The Cluster message, built from a membership snapshot (and the status key heartbeats use)."""

from __future__ import annotations

from collectives.v1 import coordinator_pb2, status_pb2
from collectives_server.coordinator.vocabulary import ClusterView, DrainReport, WorkerState

__all__ = ["cluster_to_proto", "drain_report_to_proto", "rendezvous_address", "status_key"]

_STATE_TO_PROTO = {
    WorkerState.JOINING: coordinator_pb2.WORKER_STATE_JOINING,
    WorkerState.READY: coordinator_pb2.WORKER_STATE_READY,
    WorkerState.BUSY: coordinator_pb2.WORKER_STATE_BUSY,
    WorkerState.DRAINING: coordinator_pb2.WORKER_STATE_DRAINING,
    WorkerState.LOST: coordinator_pb2.WORKER_STATE_LOST,
    WorkerState.SPARE: coordinator_pb2.WORKER_STATE_SPARE,
}


def status_key(status: status_pb2.WorkerStatus) -> bytes:
    """The status without the readings that change all the time (memory in use, and
    the recent rates and last-call times, which drift while a worker is idle).

    Heartbeats whose key did not change do not push a new Cluster to watchers
    at once (see :mod:`.membership`).
    """
    stable = status_pb2.WorkerStatus()
    stable.CopyFrom(status)
    for device in stable.devices:
        device.memory_used_bytes = 0
    stable.process_rss_bytes = 0
    stable.host_memory_available_bytes = 0
    for op in stable.ops:
        op.rate_per_s = 0.0
    for group in stable.error_groups:
        group.rate_per_s = 0.0
    for client in stable.clients:
        client.last_unix_time_s = 0.0
    return stable.SerializeToString(deterministic=True)


def cluster_to_proto(
    view: ClusterView,
    *,
    op_timeout_s: float,
    unix_offset_s: float = 0.0,
) -> coordinator_pb2.Cluster:
    """Builds the Cluster message from a membership snapshot.

    ``unix_offset_s`` turns the membership's clock into Unix time (history).
    """
    msg = coordinator_pb2.Cluster(
        generation=view.generation,
        formed=view.formed,
        world_size=view.world_size,
        store_address=rendezvous_address(view),
        version=view.version,
        min_workers=view.min_workers,
        max_workers=view.max_workers,
        status=view.status,
        op_timeout_s=op_timeout_s,
        ready=view.ready,
        membership_digest=view.membership_digest,
    )
    for w in view.workers:
        msg.workers.add(
            worker_id=w.worker_id,
            rank=w.rank,
            address=w.address,
            hostname=w.hostname,
            pid=w.pid,
            state=_STATE_TO_PROTO[w.state],
            devices=w.devices,
            joined_generation=w.joined_generation,
            last_heartbeat_age_s=w.last_heartbeat_age_s,
            backend=w.backend,
            uptime_s=w.uptime_s,
            version=w.version,
            status=w.status,
        )
    for record in view.history:
        msg.history.add(
            generation=record.generation,
            sealed_unix_time_s=record.sealed_at + unix_offset_s,
            world_size=record.world_size,
            members=record.members,
            reason=record.reason,
            sealed_by=record.sealed_by,
            membership_digest=record.membership_digest,
            carried_over=record.carried_over,
            formed_ahead=record.formed_ahead,
        )
    h = view.handoff
    if h is not None:
        msg.handoff.CopyFrom(
            coordinator_pb2.Handoff(
                drained_id=h.drained,
                drained_address=view.handoff_addresses[0],
                successor_id=h.successor,
                successor_address=view.handoff_addresses[1],
                rank=h.rank,
                generation_before=h.generation_before,
                generation_after=h.generation_after,
                started_unix_time_s=h.started_at + unix_offset_s,
                total_tensors=h.total_tensors,
                total_bytes=h.total_bytes,
                bytes_copied=h.bytes_copied,
                preparing=h.preparing,
                formed_ahead=h.formed_ahead,
                store_address=_store_of(view, h.planned[0]) if h.preparing else "",
                drain_id=h.drain_id,
            )
        )
    for report in view.drains:
        msg.drains.append(drain_report_to_proto(report, unix_offset_s))
    msg.drains_completed = view.drains_completed
    msg.drain_bytes_total = view.drain_bytes_total
    return msg


def drain_report_to_proto(report: DrainReport, unix_offset_s: float) -> coordinator_pb2.DrainReport:
    """One drain's report as the Cluster message and Coordinator.Drain carry it."""
    return coordinator_pb2.DrainReport(
        worker=report.worker,
        worker_id=report.worker_id,
        rank=report.rank,
        successor=report.successor,
        successor_id=report.successor_id,
        bytes_moved=report.bytes_moved,
        tensors_moved=report.tensors_moved,
        models_moved=report.models_moved,
        seconds=report.seconds,
        generation_before=report.generation_before,
        generation_after=report.generation_after,
        lost=report.lost,
        shrink=report.shrink,
        error=report.error,
        finished_unix_time_s=report.finished_at + unix_offset_s,
        copy_seconds=report.copy_seconds,
        prepare_seconds=report.prepare_seconds,
    )


def rendezvous_address(view: ClusterView) -> str:
    """Where the generation's process groups meet: the store its rank 0 hosts.

    Every worker hosts a TCPStore (it sends its port with Register), so a
    generation's store lives as long as the generation can (losing rank 0 ends
    it anyway) and survives the coordinator.
    """
    rank0 = next((w for w in view.workers if w.rank == 0), None)
    return _store_of(view, rank0.worker_id) if rank0 is not None else ""


def _store_of(view: ClusterView, worker_id: str) -> str:
    """The store ``worker_id`` hosts ("" when unknown: no process group can meet there)."""
    w = next((w for w in view.workers if w.worker_id == worker_id), None)
    if w is None or not w.store_port:
        return ""
    host = w.address.rsplit(":", 1)[0]
    return f"{host}:{w.store_port}"
