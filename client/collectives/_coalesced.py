"""Coalesced collectives: ``all_reduce``, ``broadcast`` and ``all_gather`` of a list of
names as one atomic op.

``cluster.all_reduce(["a", "b", "c"])`` is one op on the leader, not three: every
name is validated on every rank before any data moves (one missing or mismatched
name fails the whole op and changes nothing), the quota is judged for the op's
results together, and the data moves in as few collectives as the dtypes allow
(buckets of up to 25 MiB, like DDP's). Names may differ in dtype and shape; they
must be distinct, 1 to ``op_args.MAX_COALESCED`` of them (the rule and its
wording live in :func:`collectives.wire.op_args.check_coalesced_names`, which the
worker applies too).

This module holds the plumbing; the public methods in ``_collectives`` pass a
list or tuple of names here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from collectives._data_plane import _DataPlane
from collectives._validation import check_group, check_op, check_root
from collectives.errors import InvalidArgument
from collectives.groups import Group
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire.op_args import check_coalesced_names
from collectives.work import Work

__all__: list[str] = []


def is_coalesced(name: object) -> bool:
    """Whether a collective's ``name`` argument asks for the coalesced form."""
    return isinstance(name, (list, tuple))


def _what(kind: str, names: list[str]) -> str:
    shown = f"{names[0]!r}" + (f" (+{len(names) - 1} more)" if len(names) > 1 else "")
    return f"{kind} of {len(names)} tensor{'s' if len(names) > 1 else ''} [{shown}]"


class _Coalesced(_DataPlane):
    """The coalesced forms of broadcast, all_reduce and all_gather (see the module)."""

    if TYPE_CHECKING:  # defined by _collectives._Collectives, which derives from this class

        def _collective(self, *args: Any, **kwargs: Any) -> Any: ...

        def _world(self, deadline: float) -> int: ...

    def _broadcast_many(
        self,
        names: Sequence[str],
        src: int,
        group: Group | None,
        async_op: bool,
        timeout: float | None,
    ) -> Work[None] | None:
        checked, _ = check_coalesced_names(names)
        group = check_group(group)
        deadline = self._deadline(timeout)
        src = check_root("broadcast", src, self._world(deadline), group)
        return self._collective(
            _what("broadcast", checked),
            "Broadcast",
            lambda o: worker_pb2.BroadcastRequest(options=o, names=checked, src=src),
            deadline,
            group,
            async_op,
        )

    def _all_reduce_many(
        self,
        names: Sequence[str],
        op: str | ReduceOp,
        group: Group | None,
        out: object,
        async_op: bool,
        timeout: float | None,
    ) -> Work[None] | None:
        checked, outs = check_coalesced_names(names, _out_list(out))
        reduce_op = check_op(op)
        group = check_group(group)
        deadline = self._deadline(timeout)
        self._world(deadline)
        return self._collective(
            _what("all_reduce", checked),
            "AllReduce",
            lambda o: worker_pb2.AllReduceRequest(
                options=o, names=checked, outs=outs, op=reduce_op.wire
            ),
            deadline,
            group,
            async_op,
        )

    def _all_gather_many(
        self,
        names: Sequence[str],
        out: object,
        group: Group | None,
        async_op: bool,
        timeout: float | None,
    ) -> list[list[torch.Tensor]] | Work[list[list[torch.Tensor]]]:
        checked, outs = check_coalesced_names(names, _out_list(out))
        group = check_group(group)
        deadline = self._deadline(timeout)
        self._world(deadline)

        def fetch(resp: worker_pb2.CollectiveResponse, dl: float) -> list[list[torch.Tensor]]:
            holder = resp.result_ranks[0] if resp.result_ranks else _first_rank(group)
            stored = list(resp.result_names) or outs or checked
            return [list(self._get_rank(name, holder, dl).unbind(0)) for name in stored]

        return self._collective(
            _what("all_gather", checked),
            "AllGather",
            lambda o: worker_pb2.AllGatherRequest(options=o, names=checked, outs=outs),
            deadline,
            group,
            async_op,
            fetch,
        )


def _out_list(out: object) -> object:
    """``out`` of a coalesced op: None, or a list of names (checked by the caller)."""
    if out is not None and not is_coalesced(out):
        raise InvalidArgument(
            f"out must be None or a list of names (one per name) when names is a list, "
            f"got {type(out).__name__}"
        )
    return out


def _first_rank(group: Group | None) -> int:
    return group.ranks[0] if group is not None else 0
