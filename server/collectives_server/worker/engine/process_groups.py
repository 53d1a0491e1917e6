"""Building the process groups of one generation, and the bound on how many it holds.

A generation's groups are built without the global default group:
``ProcessGroupGloo(PrefixStore(prefix, tcp_store), rank, size, timeout)``, one
store prefix per generation and group, so the next generation's groups can be
built in the same process from the same store (torchft reconfigures this way).
On CUDA workers, the data group is NCCL and the control group (op
announcements, operand checks, outcome agreement, all small CPU tensors) stays
gloo. Every member first tells the others, over the control group, which
device it runs on: a membership mixing CPU and CUDA workers (which would
otherwise wait forever, the CUDA ranks in NCCL's rendezvous, the CPU ranks in
gloo's), or two members on one GPU of one host, is a clear formation error.
The NCCL group is wrapped so that a wait means completion on the device
(:mod:`device_completion`), and connected at once with a one-element
all-reduce, so that NCCL's own setup errors surface at formation, not inside
a client's first op.

A sub-group's NCCL communicator is split from the world's (``ncclCommSplit``,
as ``dist.new_group`` does when the default group is bound to a device): no
second bootstrap through the store. The split is collective over the world's
communicator, so every rank takes part: members with the group's color
(:class:`Split`, :func:`build_groups`), the others with no color
(:func:`sit_out_split`). Members split first, before their gloo control group
is built, so a member that fails afterwards never leaves the others waiting in
the split. Sub-groups are aborted when destroyed, like every NCCL group.

Every gloo sub-group holds file descriptors and threads on each member until
the Python object is dropped (``ProcessGroup.shutdown()`` alone frees
neither; dropping the last reference does). So a generation holds at most
``max_groups`` sub-groups (:func:`check_group_cap`), judged identically on every
rank from the groups it has (every rank runs the same ``new_group`` ops in the
same order), and a generation that ends drops every group it built.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import zlib
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from collectives.errors import ResourceExhausted
from collectives_server.hosts import is_wildcard
from collectives_server.worker.engine.agreement import all_gather_rows
from collectives_server.worker.engine.device_completion import CompletingGroup

__all__ = [
    "GroupHandles",
    "MixedDevices",
    "NcclFactory",
    "Split",
    "build_groups",
    "check_group_cap",
    "check_same_devices",
    "configure_nccl_error_handling",
    "nccl_group",
    "release_groups",
    "sit_out_split",
    "split_of",
    "subgroup_count",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    """What a sub-group's NCCL communicator is split from: the world's communicator
    (``parent``), with this group's ``color`` and its members' global ``ranks``."""

    parent: Any
    color: int
    ranks: tuple[int, ...]


# Makes the data group of a CUDA worker: (store, rank, size, timeout_s, device, split).
NcclFactory = Callable[[dist.Store, int, int, float, torch.device, Split | None], Any]


class MixedDevices(RuntimeError):
    """The members of one group do not agree on a data backend, or share a GPU."""


@dataclass
class GroupHandles:
    control: dist.ProcessGroup
    data: Any  # the control group itself on CPU workers; a CompletingGroup on CUDA
    # What made the NCCL group (sub-groups of this one are made by it too).
    nccl: NcclFactory | None = None

    def release(self) -> None:
        """Ends the data group's communicator (NCCL: aborted, in-flight kernels too).
        Gloo groups need nothing: dropping them frees their sockets and threads."""
        if isinstance(self.data, CompletingGroup):
            self.data.abort()


# NCCL's watchdog on an error or a timeout: 2 ("CleanUpOnly") aborts the communicator
# and fails its works, and leaves the process alone. torch's default (3) tears the
# whole process down, and with it every tensor the survivors of a dead peer hold.
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERROR_HANDLING = "2"


def configure_nccl_error_handling(environ: MutableMapping[str, str]) -> None:
    """Sets :data:`NCCL_ERROR_HANDLING` in ``environ`` (read when a ProcessGroupNCCL
    is made); another value set by the operator is replaced, with a warning."""
    had = environ.get(NCCL_ERROR_HANDLING_ENV)
    if had is not None and had != NCCL_ERROR_HANDLING:
        log.warning(
            "%s=%s would end this worker (and its tensors) when a peer dies; using %s",
            NCCL_ERROR_HANDLING_ENV,
            had,
            NCCL_ERROR_HANDLING,
        )
    environ[NCCL_ERROR_HANDLING_ENV] = NCCL_ERROR_HANDLING


def nccl_group(
    store: dist.Store,
    rank: int,
    size: int,
    timeout_s: float,
    device: torch.device,
    split: Split | None = None,
) -> Any:
    """torch's ProcessGroupNCCL on ``device`` (the default :data:`NcclFactory`), with
    the error handling that keeps this worker alive (:func:`configure_nccl_error_handling`);
    with ``split``, its communicator is split from the parent's when first used."""
    configure_nccl_error_handling(os.environ)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    if split is not None:
        opts.split_from = split.parent
        opts.split_color = split.color
        opts.global_ranks_in_group = list(split.ranks)
    torch.cuda.set_device(device)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def _split_parent(world: GroupHandles) -> Any | None:
    """The world's NCCL communicator when sub-groups can be split from it."""
    if not isinstance(world.data, CompletingGroup):
        return None  # gloo: every group is its own
    parent = world.data.wrapped
    return parent if getattr(parent, "supports_splitting", False) else None


def split_of(world: GroupHandles, group_id: int, ranks: list[int]) -> Split | None:
    """How a member makes sub-group ``group_id`` of ``ranks`` (global) from the world's
    handles: split from its NCCL communicator, the group id as color; None on gloo."""
    parent = _split_parent(world)
    return None if parent is None else Split(parent, group_id & 0x7FFFFFFF, tuple(ranks))


def sit_out_split(world: GroupHandles, device: torch.device) -> None:
    """A rank outside a new sub-group takes part in its split (no color), as NCCL
    requires of every rank of the parent communicator; nothing on gloo."""
    parent = _split_parent(world)
    if parent is not None:
        parent.perform_nocolor_split(device)


# Device kinds as exchanged at formation; any other accelerator type is "other"
# (tests stand ``meta`` in for ``cuda``).
_DEVICE_KINDS = ("cpu", "cuda", "other")


def _kind_code(device: torch.device) -> int:
    return _DEVICE_KINDS.index(device.type) if device.type in _DEVICE_KINDS else 2


def _host_key() -> int:
    return zlib.crc32(socket.gethostname().encode())


def check_same_devices(control: Any, rank: int, size: int, device: torch.device) -> None:
    """Every member's device kind, exchanged on the control group: raises
    :class:`MixedDevices` (on every member alike) for a mix of CPU and accelerator
    workers, or two members on one GPU of one host."""
    index = device.index if device.index is not None else -1
    row = torch.tensor([_kind_code(device), index, _host_key()], dtype=torch.int64, device="cpu")
    table = [tuple(int(v) for v in r) for r in all_gather_rows(control, row, size).tolist()]
    if len({kind for kind, _, _ in table}) > 1:
        described = ", ".join(
            f"rank {r}: {_DEVICE_KINDS[kind]}" for r, (kind, _, _) in enumerate(table)
        )
        raise MixedDevices(
            "the members run on different kinds of device and share no data backend "
            f"(NCCL for CUDA, gloo for CPU): {described}; start every worker of a "
            "cluster with the same --devices kind"
        )
    if device.type == "cpu":
        return
    seen: dict[tuple[int, int], int] = {}
    for r, (_, idx, host) in enumerate(table):
        if idx >= 0 and (idx, host) in seen:
            raise MixedDevices(
                f"ranks {seen[idx, host]} and {r} both use {device.type}:{idx} of one host; "
                "NCCL needs one GPU per rank (give each worker its own --devices)"
            )
        seen[idx, host] = r


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
    nccl: NcclFactory = nccl_group,
    split: Split | None = None,
) -> GroupHandles:
    """Blocks until every rank of the group has joined (or ``timeout_s`` passes).

    ``split``: a sub-group of an accelerator world, split from the world's NCCL
    communicator (its devices were checked when the world formed).

    Raises:
        MixedDevices: the members do not share a data backend, or share a GPU.
    """
    if split is not None:
        data = _connected_nccl(tcp_store, prefix, rank, size, timeout_s, device, nccl, split)
        try:
            control = _gloo(
                dist.PrefixStore(f"{prefix}/ctl", tcp_store), rank, size, timeout_s, host
            )
        except BaseException:
            data.abort()
            raise
        return GroupHandles(control, data, nccl)
    control = _gloo(dist.PrefixStore(f"{prefix}/ctl", tcp_store), rank, size, timeout_s, host)
    check_same_devices(control, rank, size, device)
    if device.type == "cpu":
        return GroupHandles(control, control)
    data = _connected_nccl(tcp_store, prefix, rank, size, timeout_s, device, nccl, None)
    return GroupHandles(control, data, nccl)


def _connected_nccl(
    tcp_store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    timeout_s: float,
    device: torch.device,
    nccl: NcclFactory,
    split: Split | None,
) -> CompletingGroup:
    """The NCCL data group, wrapped and connected now (a split happens here): NCCL's
    setup errors belong to formation."""
    raw = nccl(dist.PrefixStore(f"{prefix}/nccl", tcp_store), rank, size, timeout_s, device, split)
    data = CompletingGroup(raw, timeout_s)
    try:
        data.allreduce([torch.zeros(1, device=device)]).wait()
    except BaseException:
        data.abort()
        raise
    return data


def release_groups(groups: dict) -> None:
    """Ends the communicators of every group in ``groups`` (group id -> an entry with
    ``handles``): a generation that broke or was superseded aborts its NCCL groups,
    so a kernel stuck on a dead peer is torn down before the next ones are built."""
    for entry in groups.values():
        handles = getattr(entry, "handles", None)
        if handles is not None:
            handles.release()


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
