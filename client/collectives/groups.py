"""Process sub-groups, as ``torch.distributed.new_group`` returns them.

A group is created by the leader for one generation (``Cluster.new_group``) and
names a subset of that generation's global ranks. Its id is only meaningful in
that generation: after a membership change the ranks may belong to other
workers, so the SDK refuses to use a group from an older generation rather than
run a collective on the wrong workers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Group"]


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
