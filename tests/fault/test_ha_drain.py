"""A drain on an HA set: sent to a standby coordinator (which forwards it to the leader
for as long as the caller allows), and its report kept across a leader's death.

A real etcd, three coordinators, three members and a spare. The drain moves the
rank's tensors as on a single coordinator; the report and the totals live in the
membership document in etcd, so the coordinator that leads after the leader is
SIGKILLed shows them.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from ha_harness import HaCluster, cluster_of, stored_state
from helpers import assert_tensor, wait_until

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_drain_through_a_standby_and_its_report_after_a_failover(tmp_path, gen) -> None:
    ha = HaCluster(tmp_path, workers=3, min_workers=2)
    try:
        ha.workers.append(ha.start_worker())  # beyond --max-workers 3: the spare
        wait_until(lambda: any(w.state == "spare" for w in ha.client.workers()), 30, "the spare")
        held = {rank: torch.randn(2048, generator=gen) for rank in range(3)}
        for rank, t in held.items():
            ha.client.put("ha/drain", t, rank=rank)
        leader = ha.wait_for_leader()
        standby = next(i for i in ha.live_coordinators() if i != leader)
        drained = ha.members()[1]
        with grpc.insecure_channel(ha.address(standby)) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            report = stub.Drain(
                coordinator_pb2.DrainRequest(worker=drained.worker_id, timeout_s=60), timeout=90
            )
        assert report.error == "" and report.worker_id == drained.worker_id
        assert report.tensors_moved == 1 and report.bytes_moved == 2048 * 4
        ha.client.refresh()
        assert ha.members()[1].worker_id == report.successor_id
        for rank, want in held.items():
            assert_tensor(ha.client.get("ha/drain", rank=rank, timeout=30), want)
        document = stored_state(ha.etcd, ha.name)
        assert document["drains_completed"] == 1
        assert [r["worker_id"] for r in document["drains"]] == [drained.worker_id]

        # The leader dies; the next one shows the same drains.
        ha.coordinators[leader].proc.kill()
        after = ha.wait_for_leader(timeout_s=30, other_than=leader)
        shown = cluster_of(ha.address(after))
        assert shown.drains_completed == 1
        assert [r.worker_id for r in shown.drains] == [drained.worker_id]
        assert shown.drains[0].bytes_moved == report.bytes_moved
    finally:
        ha.close()
