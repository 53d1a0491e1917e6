"""The drained worker's offer to its successor: the copy ahead's snapshot, and what
counts as unchanged since it after the seal (tensor objects compared, one snapshot
per drain)."""

from __future__ import annotations

import pytest
import torch

from collectives.errors import FailedPrecondition, NotFound
from collectives_server.worker.transport.handoff import HandoffSource

G = 7


def test_only_names_still_holding_the_object_offered_ahead_are_unchanged() -> None:
    kept, replaced, deleted = torch.randn(5), torch.randn(3), torch.randn(2)
    source = HandoffSource()
    source.offer_ahead(G, {"kept": kept, "replaced": replaced, "deleted": deleted}, "drain-1")
    tensors, snapshot = source.ahead_offer(G, 0.0)
    assert snapshot == "drain-1" and set(tensors) == {"kept", "replaced", "deleted"}
    # After the seal: one name replaced (a new object, even with equal values), one
    # deleted, one added.
    source.offer(G, {"kept": kept, "replaced": replaced.clone(), "added": torch.randn(4)})
    assert source.unchanged(G, "drain-1") == {"kept"}
    assert source.tensor(G, "kept", ahead_snapshot="drain-1") is kept
    with pytest.raises(NotFound):
        source.tensor(G, "added", ahead_snapshot="drain-1")  # not part of the copy ahead


def test_a_copy_ahead_of_another_drain_counts_nothing_unchanged() -> None:
    """A successor holding the copy ahead of a drain that was called off (and asked
    again, with a new snapshot) must receive everything again: the objects of the new
    snapshot say nothing of the bytes it copied before."""
    old = torch.randn(6)
    source = HandoffSource()
    source.offer_ahead(G, {"x": old}, "drain-1")
    new = torch.randn(6)
    source.offer_ahead(G, {"x": new}, "drain-2")
    source.offer(G, {"x": new})
    assert source.unchanged(G, "drain-1") == set()
    assert source.unchanged(G, "drain-2") == {"x"}
    with pytest.raises(FailedPrecondition, match="no longer offered"):
        source.tensor(G, "x", ahead_snapshot="drain-1")
    # Another generation's question, or one after the handoff ended, finds nothing.
    assert source.unchanged(G + 1, "drain-2") == set()
    source.withdraw()
    assert source.unchanged(G, "drain-2") == set()
    with pytest.raises(FailedPrecondition):
        source.ahead_offer(G, 0.0)
