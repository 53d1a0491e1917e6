"""Client-side argument checks: pure functions, no I/O, raised before any RPC.

Everything a caller can get wrong without the server's help (names, ranks,
tensor types and dtypes, reduce ops, split sizes, timeouts) is checked here so
that the error is raised at the call site, also for ``async_op=True`` calls,
and always as :class:`~collectives.errors.InvalidArgument` naming the valid
choices. The server checks the same things again (other clients exist).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from collectives.errors import InvalidArgument, Unavailable
from collectives.groups import Group
from collectives.reduce_ops import ReduceOp, parse_reduce_op
from collectives.wire import op_specs
from collectives.wire.dtypes import to_wire
from collectives.wire.names import validate_name
from collectives.wire.op_specs import check_rank

__all__ = [
    "check_group",
    "check_name",
    "check_new_group_ranks",
    "check_op",
    "check_out",
    "check_rank",
    "check_root",
    "check_tensor",
    "check_timeout",
    "scatter_parts",
]


def check_name(name: object) -> str:
    """Raises :class:`InvalidArgument` unless ``name`` is a valid tensor name."""
    return validate_name(name)


def check_single(kind: str, name: object) -> str:
    """``name`` for an op that takes one name; a list is refused, saying which take one."""
    if isinstance(name, (list, tuple)):
        raise InvalidArgument(
            f"{kind} takes one name, got a list of {len(name)}: lists of names (one atomic "
            "op) are taken by all_reduce, broadcast and all_gather; call "
            f"{kind} once per name"
        )
    return validate_name(name)


def check_out(out: object) -> str:
    """``out=None`` means "store under the input's name": the empty string on the wire."""
    if out is None:
        return ""
    if isinstance(out, (list, tuple)):
        raise InvalidArgument(
            f"out is a list of {len(out)} names but the op has one name: give out one "
            "name, or give a list of names with a list of out names of the same length"
        )
    return validate_name(out, "out name")


def check_tensor(t: object, what: str = "tensor") -> torch.Tensor:
    """Returns ``t`` if it is a dense torch.Tensor of a wire dtype, else raises InvalidArgument."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InvalidArgument(
            f"{what} has layout {t.layout}; only dense (strided) tensors can be sent: "
            "call .to_dense() first"
        )
    if t.device.type == "meta":
        raise InvalidArgument(f"{what} is on the meta device and holds no data")
    to_wire(t.dtype)
    return t


def check_op(op: object) -> ReduceOp:
    """Parses ``"sum"``/``ReduceOp.SUM``/``dist.ReduceOp.SUM``; raises InvalidArgument."""
    return parse_reduce_op(op)


def check_group(group: object) -> Group | None:
    """``group`` must be None (every rank) or a :class:`Group` from ``new_group``."""
    if group is None or isinstance(group, Group):
        return group
    raise InvalidArgument(
        f"group must be None or a collectives.Group from Cluster.new_group, "
        f"got {type(group).__name__}"
    )


def check_root(kind: str, rank: object, world_size: int, group: Group | None) -> int:
    """``src``/``dst`` of op ``kind``: a global rank in ``[0, world_size)`` and a member of
    ``group`` (the rule and its wording live in :mod:`collectives.wire.op_specs`)."""
    members = list(group.ranks) if group is not None else None
    return op_specs.check_root(op_specs.spec_named(kind), rank, world_size, members)


def check_timeout(timeout: object, default: float) -> float:
    """Returns the call's timeout in seconds: ``default`` for None, else a positive number."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgument(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise InvalidArgument(f"timeout must be a positive finite number of seconds, got {timeout}")
    return float(timeout)


def check_new_group_ranks(ranks: object, world_size: int) -> list[int]:
    """Distinct global ranks in ``[0, world_size)``, at least one; returned ascending."""
    return op_specs.check_group_ranks(ranks, world_size)


def scatter_parts(
    t: torch.Tensor,
    world_size: int,
    dim: object = 0,
    chunk_sizes: object = None,
    of: str = "the world size",
) -> list[torch.Tensor]:
    """Splits ``t`` for ``scatter``: part i goes to rank i (of the world, or of a group:
    then ``world_size`` is the group's size and ``of`` names it in messages).

    ``tensor_split(t, world_size, dim)`` by default (sizes differ by at most one),
    or ``split(t, chunk_sizes, dim)``; raises InvalidArgument on a bad ``dim`` or
    ``chunk_sizes`` of the wrong length or sum.
    """
    if world_size <= 0:
        raise Unavailable("the cluster has no members to scatter to")
    if t.dim() == 0:
        raise InvalidArgument("cannot scatter a 0-dimensional tensor; reshape it to 1-D first")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise InvalidArgument(f"dim must be an int, got {type(dim).__name__}")
    if not -t.dim() <= dim < t.dim():
        raise InvalidArgument(
            f"dim {dim} is out of range for a {t.dim()}-dimensional tensor "
            f"(valid: {-t.dim()}..{t.dim() - 1})"
        )
    if chunk_sizes is None:
        return list(torch.tensor_split(t, world_size, dim))
    if isinstance(chunk_sizes, (str, bytes)) or not isinstance(chunk_sizes, Sequence):
        raise InvalidArgument(
            f"chunk_sizes must be a list of ints, got {type(chunk_sizes).__name__}"
        )
    sizes = list(chunk_sizes)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise InvalidArgument(f"chunk_sizes must be non-negative ints, got {sizes}")
    if len(sizes) != world_size:
        raise InvalidArgument(
            f"chunk_sizes has {len(sizes)} entries but {of} is {world_size}; give one size per rank"
        )
    if sum(sizes) != t.shape[dim]:
        raise InvalidArgument(
            f"chunk_sizes sum to {sum(sizes)} but dimension {dim} of the tensor has size "
            f"{t.shape[dim]}"
        )
    return list(torch.split(t, sizes, dim))
