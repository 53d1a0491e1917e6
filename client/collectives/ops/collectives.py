"""Collectives on named tensors: every one is a single RPC to the leader.

The leader (rank 0 of the current generation) queues the op, announces it to
every rank through the process group, validates operands across ranks, runs
it, and answers with where the result is stored. Ops returning data
(``reduce``, ``all_gather``, ``gather``) then download the result directly from
a rank that holds it.

Each request carries ``OpOptions``: the group id (0: every rank), the
generation the SDK believes is current (the leader refuses a mismatch as
``UNAVAILABLE`` without running anything) and the op timeout. A failed op is
retried only when the server marked it as never started (``executed=False``); a
reduction that may have run is never repeated behind the caller's back.

Coalesced forms: ``cluster.all_reduce(["a", "b", "c"])`` (likewise ``broadcast``
and ``all_gather`` of a list or tuple of names) is one atomic op on the leader,
not three: every name is validated on every rank before any data moves (one
missing or mismatched name fails the whole op and changes nothing), the quota is
judged for the op's results together, and the data moves in as few collectives
as the dtypes allow (buckets like DDP's). Names may differ in dtype and shape;
they must be distinct, 1 to ``op_args.MAX_COALESCED`` of them (the rule and its
wording live in :func:`collectives.wire.op_args.check_coalesced_names`, which
the worker applies too).

:class:`Collectives` is the part of ``Cluster`` that sends these ops, over a
:class:`~collectives.session.connection.Session`; it downloads results through the
:class:`~collectives.ops.data_plane.DataPlane`. Point to point (``_p2p``) sends its
ops through :meth:`Collectives.run_op`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from collectives._validation import (
    check_group,
    check_name,
    check_new_group_ranks,
    check_op,
    check_out,
    check_root,
    check_single,
)
from collectives.errors import CollectiveError, InvalidArgument, annotate
from collectives.groups import Group, generation_for
from collectives.ops.data_plane import DataPlane
from collectives.reduce_ops import ReduceOp
from collectives.session.connection import Session, server_timeout_s
from collectives.session.generation_binding import GenerationBinding, is_not_executed
from collectives.v1 import worker_pb2
from collectives.wire.op_args import check_coalesced_names, check_split_matrix
from collectives.work import IssuedOp, Work

__all__ = ["Collectives", "is_coalesced"]

R = TypeVar("R")
Request = Callable[[worker_pb2.OpOptions], Any]
Finish = Callable[[worker_pb2.CollectiveResponse, float], R]


class Collectives:
    """The collectives part of :class:`~collectives.Cluster` (see the module).

    Every method raises, besides what it lists:
        InvalidArgument: bad name, rank, op or group (at the call, also with async_op).
        Unavailable: the cluster is not formed, the leader or a peer was lost, or
            the generation changed while the op may have run.
        DeadlineExceeded: not done within ``timeout`` seconds.
        ResourceExhausted: the leader's op queue is full.
    """

    def __init__(self, session: Session, data_plane: DataPlane) -> None:
        self._session = session
        self._data_plane = data_plane

    def broadcast(
        self,
        name: str | Sequence[str],
        src: int = 0,
        group: Group | None = None,
        async_op: bool = False,
        timeout: float | None = None,
        out: str | Sequence[str] | None = None,
    ) -> Work[None] | None:
        """Copies ``name`` from global rank ``src`` to every rank of ``group``.

        Only ``src`` needs the tensor; the others' copies are created or replaced.
        A list of names is one atomic op. Like ``torch.distributed.broadcast`` it
        works in place: ``out`` is taken by every op for uniformity and refused
        here with the reason.

        Args:
            name: a tensor name, or a list of names (one atomic op).
            src: the global rank that holds the tensor. Defaults to ``0``.
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            out: refused (InvalidArgument) when given. Defaults to ``None``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: ``out`` was given, a bad name or group, or ``src`` out
                of range or not in ``group``.
            NotFound: ``src`` holds no tensor under ``name``.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        if out is not None:
            raise InvalidArgument(
                "broadcast works in place, like torch.distributed.broadcast: src keeps "
                "its tensor and the other ranks receive it under the same name, so out "
                "is not supported; broadcast the name, then use it under that name"
            )
        if is_coalesced(name):
            return self._broadcast_many(cast(Sequence[str], name), src, group, async_op, timeout)
        check_name(name)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        src = check_root("broadcast", src, self._world(deadline), group)
        return self.run_op(
            f"broadcast {name!r}",
            "Broadcast",
            lambda o: worker_pb2.BroadcastRequest(options=o, name=name, src=src),
            deadline,
            group,
            async_op,
        )

    def all_reduce(
        self,
        name: str | Sequence[str],
        op: str | ReduceOp = "sum",
        group: Group | None = None,
        out: str | Sequence[str] | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work[None] | None:
        """Reduces ``name`` across ranks; every rank stores the result under ``out`` or ``name``.

        A list of names is one atomic op; each result goes under its name, or under
        the matching name of ``out`` (a list of as many names).

        Args:
            name: a tensor name, or a list of names (one atomic op).
            op: a ``ReduceOp``, its name in any case, or a
                ``torch.distributed.ReduceOp``. Defaults to ``"sum"``.
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            out: the name to store the result under (a list for a list of names);
                None means ``name``. Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: a bad name, op, ``out`` or group.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        if is_coalesced(name):
            names = cast(Sequence[str], name)
            return self._all_reduce_many(names, op, group, out, async_op, timeout)
        check_name(name)
        reduce_op = check_op(op)
        out_name = check_out(out)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        self._world(deadline)
        return self.run_op(
            f"all_reduce {name!r}",
            "AllReduce",
            lambda o: worker_pb2.AllReduceRequest(
                options=o, name=name, op=reduce_op.wire, out=out_name
            ),
            deadline,
            group,
            async_op,
        )

    def reduce(
        self,
        name: str,
        dst: int = 0,
        op: str | ReduceOp = "sum",
        group: Group | None = None,
        out: str | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Reduces ``name`` onto global rank ``dst`` and returns the result.

        ``dst`` stores it under ``out`` or ``name``; other ranks keep their input.

        Args:
            name: the tensor name (one name only).
            dst: the global rank that receives the result. Defaults to ``0``.
            op: a ``ReduceOp``, its name in any case, or a
                ``torch.distributed.ReduceOp``. Defaults to ``"sum"``.
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            out: the name ``dst`` stores the result under; None means ``name``.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            The reduction as a CPU tensor, or a ``Work`` of it with ``async_op``. It is
            read back from ``dst`` right after the op; if another client wrote that
            name in between, the call raises ``FailedPrecondition`` (reason
            ``RESULT_REPLACED``) rather than return that value: give the result a
            name of your own.

        Raises:
            InvalidArgument: a list of names, a bad name, op or group, or ``dst``
                out of range or not in ``group``.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape;
                or the result was written over before it was read back (``RESULT_REPLACED``).
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        check_single("reduce", name)
        reduce_op = check_op(op)
        out_name = check_out(out)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        dst = check_root("reduce", dst, self._world(deadline), group)
        return self.run_op(
            f"reduce {name!r}",
            "Reduce",
            lambda o: worker_pb2.ReduceRequest(
                options=o, name=name, dst=dst, op=reduce_op.wire, out=out_name
            ),
            deadline,
            group,
            async_op,
            lambda resp, dl: self._data_plane.get_rank(
                resp.result_name or out_name or name, dst, dl, result_of=_result_of(resp)
            ),
        )

    def all_gather(
        self,
        name: str | Sequence[str],
        out: str | Sequence[str] | None = None,
        group: Group | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> list[torch.Tensor] | list[list[torch.Tensor]] | Work[Any]:
        """Gathers ``name`` from every rank of ``group``; returns the parts in rank order.

        Every member stores ``torch.stack(parts)`` under ``out`` or ``name``.

        Args:
            name: a tensor name, or a list of names (one atomic op).
            out: the name to store the stacked parts under (a list for a list of
                names); None means ``name``. Defaults to ``None``.
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            The parts as CPU tensors in rank order (for a list of names, one list of
            parts per name, in order), or a ``Work`` of that with ``async_op``; read
            back from a rank holding the result right after the op (see ``reduce``).

        Raises:
            InvalidArgument: a bad name, ``out`` or group.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape;
                or the result was written over before it was read back (``RESULT_REPLACED``).
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        if is_coalesced(name):
            names = cast(Sequence[str], name)
            return self._all_gather_many(names, out, group, async_op, timeout)
        check_name(name)
        out_name = check_out(out)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        self._world(deadline)

        def fetch(resp: worker_pb2.CollectiveResponse, dl: float) -> list[torch.Tensor]:
            holder = resp.result_ranks[0] if resp.result_ranks else _first_rank(group)
            stored = resp.result_name or out_name or name
            got = self._data_plane.get_rank(stored, holder, dl, result_of=_result_of(resp))
            return list(got.unbind(0))

        return self.run_op(
            f"all_gather {name!r}",
            "AllGather",
            lambda o: worker_pb2.AllGatherRequest(options=o, name=name, out=out_name),
            deadline,
            group,
            async_op,
            fetch,
        )

    def gather(
        self,
        name: str,
        dst: int = 0,
        out: str | None = None,
        group: Group | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
        """Gathers ``name`` onto global rank ``dst``; returns the parts in rank order.

        ``dst`` stores ``torch.stack(parts)`` under ``out`` or ``name``; other
        ranks keep their input.

        Args:
            name: the tensor name (one name only).
            dst: the global rank that receives the parts. Defaults to ``0``.
            out: the name ``dst`` stores the stacked parts under; None means ``name``.
                Defaults to ``None``.
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            The parts as CPU tensors in rank order, or a ``Work`` of them with
            ``async_op``; read back from ``dst`` right after the op (see ``reduce``).

        Raises:
            InvalidArgument: a list of names, a bad name, ``out`` or group, or
                ``dst`` out of range or not in ``group``.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape;
                or the result was written over before it was read back (``RESULT_REPLACED``).
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        check_single("gather", name)
        out_name = check_out(out)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        dst = check_root("gather", dst, self._world(deadline), group)

        def fetch(resp: worker_pb2.CollectiveResponse, dl: float) -> list[torch.Tensor]:
            stored = resp.result_name or out_name or name
            got = self._data_plane.get_rank(stored, dst, dl, result_of=_result_of(resp))
            return list(got.unbind(0))

        return self.run_op(
            f"gather {name!r}",
            "Gather",
            lambda o: worker_pb2.GatherRequest(options=o, name=name, dst=dst, out=out_name),
            deadline,
            group,
            async_op,
            fetch,
        )

    def reduce_scatter(
        self,
        name: str,
        op: str | ReduceOp = "sum",
        out: str | None = None,
        group: Group | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work[None] | None:
        """Reduces ``name`` across ranks; the i-th member stores reduced chunk i of dim 0.

        Args:
            name: the tensor name (one name only).
            op: a ``ReduceOp``, its name in any case, or a
                ``torch.distributed.ReduceOp``. Defaults to ``"sum"``.
            out: the name to store each chunk under; None means ``name``.
                Defaults to ``None``.
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: dim 0 is not divisible by the group size (from the
                server), or a bad name, op, ``out`` or group.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        check_single("reduce_scatter", name)
        reduce_op = check_op(op)
        out_name = check_out(out)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        self._world(deadline)
        return self.run_op(
            f"reduce_scatter {name!r}",
            "ReduceScatter",
            lambda o: worker_pb2.ReduceScatterRequest(
                options=o, name=name, op=reduce_op.wire, out=out_name
            ),
            deadline,
            group,
            async_op,
        )

    def all_to_all(
        self,
        name: str,
        out: str | None = None,
        group: Group | None = None,
        async_op: bool = False,
        timeout: float | None = None,
        split_sizes: Sequence[Sequence[int]] | None = None,
    ) -> Work[None] | None:
        """Chunk j (of dim 0) of member i lands as chunk i of member j.

        Without ``split_sizes`` dim 0 splits evenly. With it, member i sends
        ``split_sizes[i][j]`` rows of dim 0 to member j, in order, and member j
        stores ``torch.cat([chunk i->j for every member i])``: each member's result
        has its own dim 0 (column j's sum; 0 rows is fine). Row i must sum to dim 0
        of member i's tensor; dtypes and the dims after 0 must agree.

        Args:
            name: the tensor name (one name only).
            out: the name to store each result under; None means ``name``.
                Defaults to ``None``.
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            split_sizes: a square matrix of the group's size (group-local indices,
                the members' order); None splits dim 0 evenly. Defaults to ``None``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: dim 0 is not divisible by the group size, or (with
                ``split_sizes``) the matrix is not a square of non-negative ints of the
                group's size, or a row does not sum to its member's dim 0.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape
                (with ``split_sizes``: on dtype or the dims after 0).
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        check_single("all_to_all", name)
        out_name = check_out(out)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        world = self._world(deadline)
        splits: list[int] = []
        if split_sizes is not None:
            size = len(group.ranks) if group is not None else world
            splits = [n for row in check_split_matrix(split_sizes, size) for n in row]
        return self.run_op(
            f"all_to_all {name!r}",
            "AllToAll",
            lambda o: worker_pb2.AllToAllRequest(
                options=o, name=name, out=out_name, split_sizes=splits
            ),
            deadline,
            group,
            async_op,
        )

    def barrier(
        self, group: Group | None = None, async_op: bool = False, timeout: float | None = None
    ) -> Work[None] | None:
        """Returns once every rank of ``group`` reached the barrier (ops before it are done).

        Args:
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: a bad group.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full.
        """
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        self._world(deadline)
        return self.run_op(
            "barrier",
            "Barrier",
            lambda o: worker_pb2.BarrierRequest(options=o),
            deadline,
            group,
            async_op,
        )

    def new_group(self, ranks: list[int], timeout: float | None = None) -> Group:
        """Creates a sub-group of the current generation from global ``ranks``.

        The group is valid until the generation changes; create it again then (a
        group of an older generation is refused with ``Unavailable``, reason
        ``GENERATION_CHANGED``).

        Args:
            ranks: the members' global ranks.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            The new ``Group``, to pass as ``group=``.

        Raises:
            InvalidArgument: empty, repeated or out-of-range ranks.
            ResourceExhausted: the generation already holds the workers' maximum
                number of sub-groups (``--max-groups``).
            Unavailable: the cluster is not formed or the leader was lost.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        deadline = self._session.deadline(timeout)
        checked = check_new_group_ranks(ranks, self._world(deadline))

        def run() -> Group:
            def attempt(remaining: float) -> Group:
                snapshot = self._session.leader_snapshot(time.monotonic() + remaining)
                leader = snapshot.leader_address or ""
                options = worker_pb2.OpOptions(
                    generation=snapshot.generation,
                    timeout_s=server_timeout_s(remaining),
                    membership_digest=snapshot.membership_digest,
                )
                resp = self._session.endpoint(leader).unary("NewGroup")(
                    worker_pb2.NewGroupRequest(options=options, ranks=checked),
                    remaining,
                    f"new_group {checked} on leader {leader}",
                )
                return Group(
                    id=int(resp.group_id),
                    ranks=tuple(sorted(int(r) for r in resp.ranks)) or tuple(checked),
                    generation=int(resp.generation) or snapshot.generation,
                )

            return self._session.retry(f"new_group {checked}", deadline, attempt, is_not_executed)

        # async_op=False: _ordered returns run()'s value, not a Work.
        return cast(
            Group, self._session.ordered(f"new_group {checked}", run, deadline, async_op=False)
        )

    # --- coalesced forms ------------------------------------------------------

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
        deadline = self._session.deadline(timeout)
        src = check_root("broadcast", src, self._world(deadline), group)
        return self.run_op(
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
        deadline = self._session.deadline(timeout)
        self._world(deadline)
        return self.run_op(
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
        deadline = self._session.deadline(timeout)
        self._world(deadline)

        def fetch(resp: worker_pb2.CollectiveResponse, dl: float) -> list[list[torch.Tensor]]:
            holder = resp.result_ranks[0] if resp.result_ranks else _first_rank(group)
            stored = list(resp.result_names) or outs or checked
            of = _result_of(resp)
            return [
                list(self._data_plane.get_rank(name, holder, dl, result_of=of).unbind(0))
                for name in stored
            ]

        return self.run_op(
            _what("all_gather", checked),
            "AllGather",
            lambda o: worker_pb2.AllGatherRequest(options=o, names=checked, outs=outs),
            deadline,
            group,
            async_op,
            fetch,
        )

    # --- helpers -------------------------------------------------------------

    def _world(self, deadline: float) -> int:
        """World size of the formed cluster (validation needs it before any op RPC)."""
        return self._session.formed_snapshot(deadline).world_size

    def run_op(
        self,
        what: str,
        method: str,
        request: Request,
        deadline: float,
        group: Group | None,
        async_op: bool,
        finish: Finish[R] | None = None,
    ) -> Any:
        """Sends ``method`` to the leader in this client's op order, then ``finish``es it.

        ``request(options)`` builds the request; only an op the server marked as
        never started is retried. Returns what ``finish(response, deadline)``
        returns (None without ``finish``), or a ``Work`` of it with ``async_op``.
        """

        binding = GenerationBinding(what)
        record = IssuedOp()

        def attempt(remaining: float) -> worker_pb2.CollectiveResponse:
            snapshot = self._session.leader_snapshot(time.monotonic() + remaining)
            generation, group_id = snapshot.generation, 0
            if group is not None:
                generation, group_id = generation_for(group, snapshot, what), group.id
            binding.bind(generation, snapshot)
            record.generation = generation
            leader = snapshot.leader_address or ""
            options = worker_pb2.OpOptions(
                group_id=group_id,
                generation=generation,
                timeout_s=server_timeout_s(remaining),
                membership_digest=snapshot.digest_of(generation),
                reissued_from=binding.reissued_from,
            )
            return self._session.endpoint(leader).unary(method)(
                request(options), remaining, f"{what} on {leader}"
            )

        def run() -> Any:
            response = self._session.retry(what, deadline, attempt, binding.retryable)
            record.generation = int(response.generation) or record.generation
            if finish is None:
                return None
            try:
                return finish(response, deadline)
            except CollectiveError as err:
                raise annotate(err, f"{what} succeeded but fetching its result failed") from None

        return self._session.ordered(what, run, deadline, async_op, record)


def _result_of(resp: worker_pb2.CollectiveResponse) -> worker_pb2.ResultOf:
    """The op whose result a read-back names: the worker refuses any other value (a
    write by another client in between) instead of returning it."""
    return worker_pb2.ResultOf(generation=resp.generation, op_id=resp.op_id)


def is_coalesced(name: object) -> bool:
    """Whether a collective's ``name`` argument asks for the coalesced form."""
    return isinstance(name, (list, tuple))


def _what(kind: str, names: list[str]) -> str:
    shown = f"{names[0]!r}" + (f" (+{len(names) - 1} more)" if len(names) > 1 else "")
    return f"{kind} of {len(names)} tensor{'s' if len(names) > 1 else ''} [{shown}]"


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
