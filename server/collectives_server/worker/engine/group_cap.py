"""The bound on a generation's sub-groups, and their release when it ends (M6).

Every gloo sub-group holds ~5 file descriptors and ~3 threads on each member
until the Python object is dropped (``ProcessGroup.shutdown()`` alone frees
neither; dropping the last reference does). So a generation holds at most
``max_groups`` sub-groups, judged identically on every rank from the groups it
has (every rank runs the same ``new_group`` ops in the same order), and a
generation that ends drops every group it built.
"""

from __future__ import annotations

from collectives.errors import ResourceExhausted

__all__ = ["check_group_cap", "subgroup_count"]


def subgroup_count(groups: dict) -> int:
    """Sub-groups held, not counting the world group (id 0)."""
    return sum(1 for gid in groups if gid != 0)


def check_group_cap(held: int, max_groups: int, generation: int) -> None:
    """Raises RESOURCE_EXHAUSTED when another sub-group would exceed ``max_groups``.

    Takes the count, not the groups: the error's traceback must not keep a
    generation's groups (and their sockets) alive after it ends."""
    if held >= max_groups:
        raise ResourceExhausted(
            f"generation {generation} already holds {held} groups, the most this worker "
            f"allows (--max-groups {max_groups}); groups are freed when the generation ends"
        )
