"""The op spec table: every sequenced op kind's rules, written once.

Each op the leader sequences has one :class:`OpSpec`, keyed by its
``OpKind`` (the proto enum in ``OpDescriptor``): who must contribute an
operand, who stores the result and in what shape, whether it reduces, whether
small operands may travel inside the operand exchange, which argument carries
its root rank, and its argument checks. The SDK's checks, the worker's
servicer, the cross-rank validation (``collectives_server.worker.engine.validation``)
and the worker's handlers all read this table, so each rule has one wording
wherever it is caught.

This module does not import torch (the CLI reads it and starts without torch).
Kinds that are not data collectives (``noop``, ``stop``, ``new_group``, the
model ops) have specs too, so that logs and metrics name every kind alike.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from collectives.errors import InvalidArgument
from collectives.v1 import worker_pb2

if TYPE_CHECKING:  # the CLI imports this module and must start without torch
    import torch

__all__ = [
    "OpKind",
    "Operand",
    "Stores",
    "Shape",
    "OpSpec",
    "SPECS",
    "spec",
    "spec_named",
    "kind_name",
    "check_rank",
    "check_root",
    "check_group_ranks",
    "check_dim0_divisible",
    "subject",
    # coalesced ops
    "COALESCED_BASE",
]


class OpKind(enum.IntEnum):
    """The proto ``OpKind`` as a Python enum (same values)."""

    NOOP = worker_pb2.OP_KIND_NOOP
    STOP = worker_pb2.OP_KIND_STOP
    BROADCAST = worker_pb2.OP_KIND_BROADCAST
    ALL_REDUCE = worker_pb2.OP_KIND_ALL_REDUCE
    REDUCE = worker_pb2.OP_KIND_REDUCE
    ALL_GATHER = worker_pb2.OP_KIND_ALL_GATHER
    GATHER = worker_pb2.OP_KIND_GATHER
    REDUCE_SCATTER = worker_pb2.OP_KIND_REDUCE_SCATTER
    ALL_TO_ALL = worker_pb2.OP_KIND_ALL_TO_ALL
    BARRIER = worker_pb2.OP_KIND_BARRIER
    NEW_GROUP = worker_pb2.OP_KIND_NEW_GROUP
    ALL_REDUCE_GRADIENTS = worker_pb2.OP_KIND_ALL_REDUCE_GRADIENTS
    TRAIN_STEP = worker_pb2.OP_KIND_TRAIN_STEP
    EXCHANGE = worker_pb2.OP_KIND_EXCHANGE
    DESTROY_GROUP = worker_pb2.OP_KIND_DESTROY_GROUP
    ALL_REDUCE_COALESCED = worker_pb2.OP_KIND_ALL_REDUCE_COALESCED
    BROADCAST_COALESCED = worker_pb2.OP_KIND_BROADCAST_COALESCED
    ALL_GATHER_COALESCED = worker_pb2.OP_KIND_ALL_GATHER_COALESCED
    ALL_TO_ALL_UNEVEN = worker_pb2.OP_KIND_ALL_TO_ALL_UNEVEN
    PUBLISH_MODEL = worker_pb2.OP_KIND_PUBLISH_MODEL
    REPLICATE = worker_pb2.OP_KIND_REPLICATE
    STEP = worker_pb2.OP_KIND_STEP
    ZERO_GRAD = worker_pb2.OP_KIND_ZERO_GRAD


class Operand(enum.Enum):
    """Whose named operand must be present before any data moves."""

    NONE = "none"  # barrier, control and model ops
    ROOT = "root"  # broadcast: only src
    MEMBERS = "members"  # every member of the group
    SOURCES = "sources"  # exchange: every pair's src


class Stores(enum.Enum):
    """Which members store the op's result."""

    NONE = "none"
    MEMBERS = "members"
    ROOT = "root"  # reduce, gather: dst only
    NOT_ROOT = "not_root"  # broadcast: src keeps its own
    DESTINATIONS = "destinations"  # exchange: every pair's dst


class Shape(enum.Enum):
    """The result's shape from the operand's shape and the group's size."""

    SAME = "same"
    STACKED = "stacked"  # (size, *shape): one operand per member
    CHUNK = "chunk"  # (shape[0] // size, *shape[1:]): this member's chunk of dim 0


@dataclass(frozen=True)
class OpSpec:
    kind: OpKind
    name: str  # as the SDK and the logs spell it: "all_reduce"
    args: str = ""  # the OpDescriptor oneof field carrying its arguments
    operand: Operand = Operand.NONE
    stores: Stores = Stores.NONE
    shape: Shape = Shape.SAME
    root_role: str = ""  # "src"/"dst" for ops with a root rank
    reducing: bool = False
    inline: bool = False  # small operands may ride in the operand exchange
    splits_dim0: bool = False  # dim 0 must be divisible by the group size
    sequenced: bool = True  # runs as a numbered op (noop/stop are not ops)

    @property
    def is_collective(self) -> bool:
        """A collective on one named tensor (or barrier): the tensor pipeline runs it."""
        return self.args == "tensor"

    def contributors(self, members: Sequence[int], root: int) -> list[int]:
        """The global ranks whose operand is required (ascending)."""
        if self.operand is Operand.ROOT:
            return [root]
        if self.operand is Operand.MEMBERS:
            return list(members)
        return []

    def result_ranks(self, members: Sequence[int], root: int) -> list[int]:
        """The global ranks that hold the result once the op committed (for the reply;
        broadcast's src holds it too, as its own tensor)."""
        if self.stores is Stores.ROOT:
            return [root]
        if self.stores is Stores.NONE:
            return []
        return list(members)

    def stores_on(self, rank: int, root: int) -> bool:
        """Whether member ``rank`` stores a result of this op."""
        if self.stores is Stores.MEMBERS:
            return True
        if self.stores is Stores.ROOT:
            return rank == root
        if self.stores is Stores.NOT_ROOT:
            return rank != root
        return False

    def result_shape(self, shape: Sequence[int], size: int) -> tuple[int, ...]:
        shape = tuple(shape)
        if self.shape is Shape.STACKED:
            return (size, *shape)
        if self.shape is Shape.CHUNK and shape:
            return (shape[0] // size, *shape[1:])
        return shape

    def result_nbytes(
        self, dtype: torch.dtype | None, shape: Sequence[int], size: int, rank: int, root: int
    ) -> int:
        """Bytes member ``rank`` stores (0: nothing)."""
        if dtype is None or not self.stores_on(rank, root):
            return 0
        n = dtype.itemsize
        for d in self.result_shape(shape, size):
            n *= d
        return n

    def operand_nbytes(self, dtype: torch.dtype | None, result_shape: Sequence[int], size: int):
        """One member's operand bytes, from the result's dtype and shape (for metrics)."""
        if dtype is None:
            return 0
        n = dtype.itemsize
        for d in result_shape:
            n *= d
        if self.shape is Shape.STACKED and result_shape and result_shape[0]:
            n //= result_shape[0]
        elif self.shape is Shape.CHUNK:
            n *= max(size, 1)
        return n


def _tensor(kind: OpKind, name: str, **rules) -> OpSpec:
    return OpSpec(kind, name, args="tensor", **rules)


_MEMBERS = {"operand": Operand.MEMBERS, "inline": True}
SPECS: dict[OpKind, OpSpec] = {
    s.kind: s
    for s in (
        OpSpec(OpKind.NOOP, "noop", sequenced=False),
        OpSpec(OpKind.STOP, "stop", sequenced=False),
        _tensor(
            OpKind.BROADCAST,
            "broadcast",
            operand=Operand.ROOT,
            stores=Stores.NOT_ROOT,
            root_role="src",
            inline=True,
        ),
        _tensor(OpKind.ALL_REDUCE, "all_reduce", stores=Stores.MEMBERS, reducing=True, **_MEMBERS),
        _tensor(
            OpKind.REDUCE,
            "reduce",
            stores=Stores.ROOT,
            root_role="dst",
            reducing=True,
            **_MEMBERS,
        ),
        _tensor(
            OpKind.ALL_GATHER, "all_gather", stores=Stores.MEMBERS, shape=Shape.STACKED, **_MEMBERS
        ),
        _tensor(
            OpKind.GATHER,
            "gather",
            stores=Stores.ROOT,
            shape=Shape.STACKED,
            root_role="dst",
            **_MEMBERS,
        ),
        _tensor(
            OpKind.REDUCE_SCATTER,
            "reduce_scatter",
            stores=Stores.MEMBERS,
            shape=Shape.CHUNK,
            reducing=True,
            splits_dim0=True,
            **_MEMBERS,
        ),
        _tensor(
            OpKind.ALL_TO_ALL, "all_to_all", stores=Stores.MEMBERS, splits_dim0=True, **_MEMBERS
        ),
        _tensor(OpKind.BARRIER, "barrier"),
        OpSpec(OpKind.NEW_GROUP, "new_group", args="new_group"),
        OpSpec(
            OpKind.ALL_REDUCE_GRADIENTS, "all_reduce_gradients", args="gradients", reducing=True
        ),
        OpSpec(OpKind.TRAIN_STEP, "train_step", args="train_step"),
        OpSpec(
            OpKind.EXCHANGE,
            "exchange",
            args="exchange",
            operand=Operand.SOURCES,
            stores=Stores.DESTINATIONS,
        ),
        OpSpec(OpKind.DESTROY_GROUP, "destroy_group", args="destroy_group"),
        OpSpec(OpKind.PUBLISH_MODEL, "publish", args="publish"),
        OpSpec(OpKind.STEP, "step", args="step"),
        OpSpec(OpKind.ZERO_GRAD, "zero_grad", args="zero_grad"),
        # put(name, t) on every rank, sent once: the leader's upload (the root's
        # operand) is stored by every member, the root included (it adopts it).
        OpSpec(
            OpKind.REPLICATE,
            "replicate",
            args="replicate",
            operand=Operand.ROOT,
            stores=Stores.MEMBERS,
            root_role="src",
        ),
        OpSpec(
            OpKind.ALL_REDUCE_COALESCED,
            "all_reduce_coalesced",
            args="coalesced",
            operand=Operand.MEMBERS,
            stores=Stores.MEMBERS,
            reducing=True,
        ),
        OpSpec(
            OpKind.BROADCAST_COALESCED,
            "broadcast_coalesced",
            args="coalesced",
            operand=Operand.ROOT,
            stores=Stores.NOT_ROOT,
            root_role="src",
        ),
        OpSpec(
            OpKind.ALL_GATHER_COALESCED,
            "all_gather_coalesced",
            args="coalesced",
            operand=Operand.MEMBERS,
            stores=Stores.MEMBERS,
            shape=Shape.STACKED,
        ),
        OpSpec(
            OpKind.ALL_TO_ALL_UNEVEN,
            "all_to_all_uneven",
            args="uneven",
            operand=Operand.MEMBERS,
            stores=Stores.MEMBERS,
        ),
    )
}
_BY_NAME = {s.name: s for s in SPECS.values()}


def spec(kind: int) -> OpSpec:
    """The spec of a proto ``OpKind`` value; ValueError for an unknown one."""
    try:
        return SPECS[OpKind(kind)]
    except ValueError:
        raise ValueError(f"unknown op kind {kind}") from None


def spec_named(name: str) -> OpSpec:
    """The spec of an op kind by its name (``"all_reduce"``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown op kind {name!r}") from None


def kind_name(kind: int) -> str:
    """``"all_reduce"`` for ``OP_KIND_ALL_REDUCE``; ``"kind N"`` for an unknown value."""
    try:
        return spec(kind).name
    except ValueError:
        return f"kind {kind}"


# --------------------------------------------------------------- argument checks
def check_rank(rank: object, world_size: int, what: str = "rank") -> int:
    """Returns ``rank`` if it is an int in ``[0, world_size)``, else raises InvalidArgument."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise InvalidArgument(f"{what} must be an int, got {type(rank).__name__}")
    if not 0 <= rank < world_size:
        valid = f"0..{world_size - 1}" if world_size > 0 else "none"
        raise InvalidArgument(
            f"{what} {rank} is out of range; valid ranks are {valid} (world size {world_size})"
        )
    return rank


def check_root(op: OpSpec, root: object, world_size: int, members: Sequence[int] | None) -> int:
    """An op's src/dst: a global rank in ``[0, world_size)`` and a member of the group
    (``members``: the group's global ranks; None: every rank)."""
    what = op.root_role or "root"
    rank = check_rank(root, world_size, what)
    if members is not None and rank not in members:
        raise InvalidArgument(
            f"{what} {rank} is not a member of the group (global ranks {list(members)}); "
            f"{what} is a global rank, as in torch.distributed"
        )
    return rank


def check_group_ranks(ranks: object, world_size: int) -> list[int]:
    """A new group's members: distinct global ranks in ``[0, world_size)``, at least one;
    returned ascending."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence | set | frozenset):
        raise InvalidArgument(f"ranks must be a list of ints, got {type(ranks).__name__}")
    checked = [check_rank(r, world_size) for r in ranks]
    if not checked:
        raise InvalidArgument("a group needs at least one rank")
    if len(set(checked)) != len(checked):
        dupes = sorted({r for r in checked if checked.count(r) > 1})
        raise InvalidArgument(f"ranks must be distinct; repeated: {dupes}")
    return sorted(checked)


def check_dim0_divisible(op: OpSpec, name: str, shape: Sequence[int], size: int) -> None:
    """reduce_scatter/all_to_all need dim 0 divisible by the group size."""
    if op.splits_dim0 and (not shape or shape[0] % size):
        dim0 = shape[0] if shape else "a 0-dim tensor"
        raise InvalidArgument(
            f"dim 0 must be divisible by the group size {size}; got {dim0} (shape {list(shape)})"
        )


# ------------------------------------------------------------ coalesced ops
# A coalesced kind validates each of its names with its single-tensor kind's spec.
COALESCED_BASE: dict[OpKind, OpKind] = {
    OpKind.ALL_REDUCE_COALESCED: OpKind.ALL_REDUCE,
    OpKind.BROADCAST_COALESCED: OpKind.BROADCAST,
    OpKind.ALL_GATHER_COALESCED: OpKind.ALL_GATHER,
}


def subject(desc: worker_pb2.OpDescriptor) -> str:
    """The tensor or model an op is about ("" for barrier, new_group, ticks)."""
    field = desc.WhichOneof("args")
    if field in ("tensor", "uneven", "exchange"):
        return getattr(desc, field).name
    if field == "replicate":
        return desc.replicate.out
    if field == "coalesced":
        names = list(desc.coalesced.names)
        return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})" if names else ""
    if field in ("gradients", "train_step", "publish"):
        return getattr(desc, field).model
    return ""
