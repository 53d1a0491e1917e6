"""Process sub-groups, as ``torch.distributed.new_group`` returns them.

A group is created by the leader for one generation (``Cluster.new_group``) and
names a subset of that generation's global ranks. Its id is only meaningful in
that generation and the ones drains carried over from it (rank for rank the
same workers' state; the workers rebuild the group in each): after any other
membership change the ranks may belong to other workers, so the SDK refuses to
use the group rather than run a collective on the wrong workers
(:func:`generation_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

from collectives.errors import Reason, Unavailable
from collectives.wire.cluster_state import ClusterSnapshot

__all__ = ["Group", "generation_for"]


def generation_for(group: Group, snapshot: ClusterSnapshot, what: str) -> int:
    """The generation to send ``group``'s op for: ``snapshot``'s, when the group was made
    in it or in one that drains carried over into it.

    Raises:
        Unavailable: the group belongs to another membership (``GENERATION_CHANGED``:
            create it again), or a drain's handoff has not ended yet (not executed:
            retried).
    """
    if group.generation == snapshot.generation:
        return group.generation
    carried = (
        snapshot.carried_over_since(group.generation)
        if group.generation < snapshot.generation
        else False
    )
    if carried:
        return snapshot.generation
    if carried is None:
        raise Unavailable(
            f"{what}: a drain is handing a rank over; the group waits for it",
            executed=False,
            generation=group.generation,
            reason=Reason.GENERATION_CHANGED,
        )
    raise Unavailable(
        f"{what}: group {list(group.ranks)} (id {group.id}) belongs to generation "
        f"{group.generation} but the cluster is at generation {snapshot.generation}; "
        "create it again with new_group",
        generation=group.generation,
        reason=Reason.GENERATION_CHANGED,
    )


@dataclass(frozen=True)
class Group:
    """A subset of the global ranks of one generation; pass it as ``group=``."""

    # Id assigned by the leader; 0 would mean "every rank" on the wire.
    id: int
    # Global ranks of the members, ascending.
    ranks: tuple[int, ...]
    # Generation the group was created in.
    generation: int

    @property
    def size(self) -> int:
        """Number of member ranks."""
        return len(self.ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self.ranks

    def group_rank(self, global_rank: int) -> int:
        """Position of ``global_rank`` in the group (as ``dist.get_group_rank``).

        Args:
            global_rank: a member's global rank.

        Returns:
            Its index in :attr:`ranks`.

        Raises:
            ValueError: ``global_rank`` is not a member.
        """
        return self.ranks.index(global_rank)
