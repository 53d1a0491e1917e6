"""Building the process groups of one generation.

A generation's groups are built without the global default group:
``ProcessGroupGloo(PrefixStore(prefix, tcp_store), rank, size, timeout)``, one
store prefix per generation and group, so the next generation's groups can be
built in the same process from the same store (torchft reconfigures this way).
On CUDA workers, the data group is NCCL and the control group (op
announcements, operand checks, outcome agreement, all small CPU tensors) stays
gloo.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from collectives_server.hosts import is_wildcard

__all__ = ["GroupHandles", "build_groups"]


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
