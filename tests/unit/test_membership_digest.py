"""The membership digest's checks, on real generations: a leader refuses an op sent for
another membership of its generation number, a follower refuses an op announced
for another one (before any data moves), and a worker refuses to join a
generation whose record does not name its members."""

from __future__ import annotations

import grpc
import pytest
import torch
from generation_pair import DIGEST, TIMEOUT_S, Pair, descriptor

from collectives.errors import CollectiveError, Unavailable
from collectives.reduce_ops import ReduceOp
from collectives.v1 import coordinator_pb2
from collectives_server.membership_digest import membership_digest
from collectives_server.worker.daemon import membership_refusal


def test_the_digest_is_of_the_ids_in_rank_order() -> None:
    assert membership_digest(["w-1", "w-2"]) != membership_digest(["w-2", "w-1"])
    assert membership_digest(["w-1", "w-2"]) != membership_digest(["w-1", "w-2", "w-3"])
    assert membership_digest([]) == ""
    assert len(membership_digest(["w-1"])) == 16


def test_a_leader_refuses_an_op_for_another_membership_before_it_runs() -> None:
    pair = Pair()
    try:
        x = [torch.randn(5), torch.randn(5)]
        for store, t in zip(pair.stores, x, strict=True):
            store.put("x", t)
        forged = membership_digest(["w-9", "w-8"])
        with pytest.raises(Unavailable) as info:
            pair.generations[0].submit(
                descriptor("all_reduce", name="x", op=ReduceOp.SUM.wire),
                expected_generation=1,
                expected_digest=forged,
            )
        assert forged in str(info.value) and DIGEST in str(info.value)
        assert info.value.executed is False
        for store, t in zip(pair.stores, x, strict=True):
            assert torch.equal(store.peek("x"), t)  # nothing ran
        # The right digest runs, and gives torch's sum.
        ticket = pair.generations[0].submit(
            descriptor("all_reduce", name="x", op=ReduceOp.SUM.wire),
            expected_generation=1,
            expected_digest=DIGEST,
        )
        ticket.future.result(TIMEOUT_S)
        assert torch.allclose(pair.stores[0].peek("x"), x[0] + x[1])
    finally:
        pair.close()


def test_a_follower_refuses_an_op_announced_for_another_membership() -> None:
    pair = Pair(rebuild_after_s=60.0)
    try:
        x = [torch.randn(5), torch.randn(5)]
        for store, t in zip(pair.stores, x, strict=True):
            store.put("x", t)
        # A leader whose sequencer believes in another membership than its group's.
        pair.generations[0]._seq.membership_digest = "ffffffffffffffff"
        leader = pair.generations[0]
        ticket = leader.submit(descriptor("all_reduce", name="x", op=ReduceOp.SUM.wire))
        with pytest.raises(CollectiveError) as info:
            ticket.future.result(TIMEOUT_S)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "membership ffffffffffffffff" in (pair.generations[1].failure or "")
        for store, t in zip(pair.stores, x, strict=True):
            assert torch.equal(store.peek("x"), t)  # no data moved, nothing committed
    finally:
        pair.generations[1].stop()  # it waits to rebuild its group otherwise
        pair.close()


def _cluster(ids_by_rank: list[str], digest: str | None = None) -> coordinator_pb2.Cluster:
    msg = coordinator_pb2.Cluster(generation=3, formed=True, world_size=len(ids_by_rank))
    for rank, worker_id in enumerate(ids_by_rank):
        msg.workers.add(worker_id=worker_id, rank=rank, address=f"127.0.0.1:{7000 + rank}")
    msg.membership_digest = membership_digest(ids_by_rank) if digest is None else digest
    return msg


def test_a_worker_joins_only_the_membership_its_record_names() -> None:
    good = _cluster(["w-1", "w-2", "w-3"])
    assert membership_refusal(good, [w for w in good.workers if w.rank >= 0]) is None
    stale = _cluster(["w-1", "w-2", "w-3"], digest=membership_digest(["w-1", "w-2"]))
    refusal = membership_refusal(stale, list(stale.workers))
    assert refusal is not None and membership_digest(["w-1", "w-2"]) in refusal
    missing = _cluster(["w-1", "w-2"], digest="")
    assert "(none)" in (membership_refusal(missing, list(missing.workers)) or "")
    gap = _cluster(["w-1", "w-2"])
    gap.world_size = 3
    assert "ranks" in (membership_refusal(gap, list(gap.workers)) or "")
