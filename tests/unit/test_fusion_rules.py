"""Op fusion's pieces without a cluster: which queued ops may join a run
(``worker/fusion.py``), the sequencer's peek/take, and a fused announcement and
exchange over gloo (every rank gets the same ops and each op's own slice)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fake_pg import run_ranks
from test_fake_pg import gloo  # noqa: F401  (fixture)
from test_sequencer import FakeClock

from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine import agreement, descriptor, fusion
from collectives_server.worker.engine.sequencer import Sequencer
from collectives_server.worker.engine.validation import INFO_BYTES, info_values


def op(kind: OpKind = OpKind.ALL_REDUCE, name: str = "x", out: str = "", group: int = 0):
    return worker_pb2.OpDescriptor(
        kind=kind, group_id=group, tensor=worker_pb2.TensorOpArgs(name=name, out=out)
    )


def test_a_run_takes_small_world_ops_on_distinct_names() -> None:
    run = fusion.Run()
    assert run.admits(op(name="a"), 16)
    run.add(op(name="a"), 16)
    assert run.admits(op(OpKind.BROADCAST, name="b"), 0)
    assert run.admits(op(OpKind.BARRIER, name=""), 0)
    # A name read or written by an op already in the run.
    assert not run.admits(op(name="a"), 16)
    assert not run.admits(op(name="c", out="a"), 16)
    run.add(op(name="c", out="d"), 16)
    assert not run.admits(op(name="d"), 16)
    # Not inline (the leader saw a large operand), a sub-group, not a tensor collective.
    assert not run.admits(op(name="e"), None)
    assert not run.admits(op(name="e", group=3), 16)
    new_group = worker_pb2.OpDescriptor(
        kind=OpKind.NEW_GROUP, new_group=worker_pb2.NewGroupArgs(ranks=[0, 1])
    )
    assert not run.admits(new_group, 0)


def test_a_run_is_bounded_in_ops_and_bytes() -> None:
    run = fusion.Run()
    for i in range(fusion.MAX_OPS):
        assert run.admits(op(name=f"n{i}"), 0)
        run.add(op(name=f"n{i}"), 0)
    assert not run.admits(op(name="one-more"), 0)
    big = fusion.MAX_ROW_BYTES - INFO_BYTES
    run = fusion.Run()
    run.add(op(name="a"), big)  # the first op alone may fill the row
    assert not run.admits(op(name="b"), 0)


def test_peek_leaves_the_head_queued_and_take_starts_only_the_head() -> None:
    clock = FakeClock()
    seq = Sequencer(1, 8, 1.0, clock)
    a = seq.admit(op(name="a"), 10.0)
    b = seq.admit(op(name="b"), 10.0)
    assert seq.peek() is a and seq.depth == 2 and not a.started
    assert not seq.take(b)  # not the head
    assert seq.take(a) and a.started and seq.depth == 1
    assert not seq.take(a)  # already taken
    assert seq.peek() is b


def test_peek_drops_expired_ops_without_starting_the_next() -> None:
    clock = FakeClock()
    seq = Sequencer(1, 8, 1.0, clock)
    a = seq.admit(op(name="a"), 1.0)
    b = seq.admit(op(name="b"), 10.0)
    clock.advance(2.0)
    assert seq.peek() is b and not b.started and seq.depth == 1
    assert a.future.done() and a.future.exception().code.name == "DEADLINE_EXCEEDED"


@pytest.mark.parametrize("size", (2, 3))
def test_fused_announcement_and_exchange_over_gloo(gloo, size: int) -> None:  # noqa: F811
    """The leader announces three ops at once (one longer than a slot); every rank
    receives them in order with their capacities, then one all-gather carries each
    op's info and inline bytes, and each op's slice reads back as if exchanged alone."""
    items = [
        (op(name="a"), 16),
        (op(OpKind.BARRIER, name=""), 0),
        (op(name="x" * 1500), None),
    ]
    operands = [
        [torch.arange(4, dtype=torch.float32) + 10 * r, None, torch.full((3,), r)]
        for r in range(size)
    ]

    def fn(rank: int, pg: Any) -> tuple[list[bytes], list[int | None], list[Any]]:
        if rank == 0:
            pending = descriptor.announce_batch(pg, items, wait=False)
            got = items
        else:
            pending = None
            got = descriptor.receive_batch(pg)
        parts = []
        for (_, inline), t in zip(got, operands[rank], strict=True):
            parts.append((info_values(t, True, (0, -1)), t, inline or 0))
        exchanged = agreement.exchange_fused(pg, size, parts, pending)
        payloads = [ex.payload(1, ex.infos[1]).clone() for ex in exchanged[:1]]
        shapes = [[info.shape for info in ex.infos] for ex in exchanged]
        return [d.SerializeToString() for d, _ in got], [i for _, i in got], [payloads, shapes]

    for bodies, inlines, (payloads, shapes) in run_ranks(gloo(size), fn, timeout_s=20):
        assert bodies == [d.SerializeToString() for d, _ in items]
        assert inlines == [16, 0, None]
        assert torch.equal(payloads[0], operands[1][0])
        assert shapes[0] == [(4,)] * size and shapes[2] == [(3,)] * size


def test_a_single_op_receiver_refuses_a_fused_announcement(gloo) -> None:  # noqa: F811
    def fn(rank: int, pg: dist.ProcessGroup) -> str:
        if rank == 0:
            descriptor.announce_batch(pg, [(op(name="a"), 0), (op(name="b"), 0)])
            return ""
        with pytest.raises(ValueError, match="announced 2 together"):
            descriptor.receive(pg)
        return "refused"

    assert run_ranks(gloo(2), fn, timeout_s=20) == ["", "refused"]
