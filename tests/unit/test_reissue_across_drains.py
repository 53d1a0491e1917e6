"""Which never-run collectives the SDK sends again: across generations that drains
carried over (every rank holds what it held), never across any other change."""

from __future__ import annotations

import pytest

from collectives.errors import Reason, Unavailable
from collectives.session.generation_binding import GenerationBinding
from collectives.v1 import coordinator_pb2
from collectives.wire.cluster_state import ClusterSnapshot


def snapshot(generation: int, carried: dict[int, bool], drain_into: int = 0) -> ClusterSnapshot:
    """A formed view at ``generation`` whose history marks ``carried`` generations."""
    msg = coordinator_pb2.Cluster(generation=generation, formed=True, world_size=2, version=9)
    for g, carried_over in sorted(carried.items()):
        msg.history.add(generation=g, world_size=2, carried_over=carried_over)
    if drain_into:
        msg.handoff.CopyFrom(
            coordinator_pb2.Handoff(generation_before=drain_into - 1, generation_after=drain_into)
        )
    return ClusterSnapshot.from_proto(msg)


def refused() -> Unavailable:
    """What a leader answers for an op of a generation that ended before it ran."""
    return Unavailable(
        "generation 3 was superseded", executed=False, reason=Reason.GENERATION_CHANGED
    )


def test_an_op_moves_across_generations_drains_carried_over() -> None:
    binding = GenerationBinding("all_reduce of 'x'")
    binding.bind(3, snapshot(3, {3: False}))
    assert binding.retryable(refused())
    binding.bind(5, snapshot(5, {3: False, 4: True, 5: True}))
    assert binding.generation == 5 and binding.reissued == 1 and binding.reissued_from == 3
    assert binding.retryable(refused()), "still bound: a later drain may move it again"


def test_a_change_that_was_not_carried_over_is_surfaced() -> None:
    binding = GenerationBinding("all_reduce of 'x'")
    binding.bind(3, snapshot(3, {3: False}))
    assert binding.reissued_from == 0
    with pytest.raises(Unavailable, match="not retried on the new membership") as err:
        binding.bind(5, snapshot(5, {4: True, 5: False}))  # a crash after a drain
    assert err.value.reason == Reason.GENERATION_CHANGED and err.value.executed is False
    assert not binding.retryable(refused())


def test_a_generation_missing_from_the_history_is_not_assumed_carried() -> None:
    binding = GenerationBinding("barrier")
    binding.bind(3, snapshot(3, {}))
    with pytest.raises(Unavailable):
        binding.bind(5, snapshot(5, {5: True}))  # 4: unknown


def test_while_a_drain_hands_over_the_op_waits_without_giving_up() -> None:
    binding = GenerationBinding("reduce of 'x'")
    binding.bind(3, snapshot(3, {3: False}))
    with pytest.raises(Unavailable, match="handing a rank over") as err:
        binding.bind(4, snapshot(4, {4: False}, drain_into=4))
    assert binding.retryable(err.value), "a pending handoff is retried, not surfaced"
    binding.bind(4, snapshot(4, {4: True}))
    assert binding.reissued == 1


def test_without_a_view_any_change_is_surfaced() -> None:
    binding = GenerationBinding("broadcast of 'x'")
    binding.bind(3)
    with pytest.raises(Unavailable):
        binding.bind(4)
