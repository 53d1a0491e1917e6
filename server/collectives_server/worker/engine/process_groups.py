"""Building the process groups of one generation, and the bound on how many it holds.

A generation's groups are built without the global default group:
``ProcessGroupGloo(PrefixStore(prefix, tcp_store), rank, size, timeout)``, one
store prefix per generation and group, so the next generation's groups can be
built in the same process from the same store (torchft reconfigures this way).
On CUDA workers, the data group is NCCL and the control group (op
announcements, operand checks, outcome agreement, all small CPU tensors) stays
gloo.

Every gloo sub-group holds file descriptors and threads on each member until
the Python object is dropped (``ProcessGroup.shutdown()`` alone frees
neither; dropping the last reference does). So a generation holds at most
``max_groups`` sub-groups (:func:`check_group_cap`), judged identically on every
rank from the groups it has (every rank runs the same ``new_group`` ops in the
same order), and a generation that ends drops every group it built.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from collectives.errors import ResourceExhausted
from collectives_server.hosts import is_wildcard

__all__ = ["GroupHandles", "build_groups", "check_group_cap", "subgroup_count"]


@dataclass
class GroupHandles:
    control: dist.ProcessGroup
    data: dist.ProcessGroup


def _gloo(store: dist.Store, rank: int, size: int, timeout_s: float, host: str | None):
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_wildcard(host):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def build_groups(
    tcp_store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    timeout_s: float,
    device: torch.device,
    host: str | None = None,
) -> GroupHandles:
    """Blocks until every rank of the group has joined (or ``timeout_s`` passes)."""
    control = _gloo(dist.PrefixStore(f"{prefix}/ctl", tcp_store), rank, size, timeout_s, host)
    if device.type != "cuda":
        return GroupHandles(control, control)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    torch.cuda.set_device(device)
    data = dist.ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/nccl", tcp_store), rank, size, opts)
    return GroupHandles(control, data)


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
