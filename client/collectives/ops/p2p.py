"""Point to point (``send``, ``exchange``) and ``destroy_group``: single RPCs to the leader.

``send`` is one ``(src, dst)`` pair and ``exchange`` several in one op, like
``torch.distributed.batch_isend_irecv``: every dst stores what its src held
*before* the op, so a ring shift works with the result under the same name.
Ranks are global, as in torch.distributed, and must be members of ``group``.
``destroy_group`` is sequenced like a collective, so every rank drops the group
at the same point of the op order; using the group afterwards is ``NOT_FOUND``.

:class:`PeerToPeer` is the part of ``Cluster`` that makes these calls: it sends
``send``/``exchange`` through :meth:`Collectives.run_op
<collectives.ops.collectives.Collectives.run_op>` and tells the
:class:`~collectives.ops.data_plane.DataPlane` which groups it destroyed.
"""

from __future__ import annotations

import time
from typing import cast

from collectives._validation import check_group, check_out, check_single
from collectives.errors import InvalidArgument, NotFound, Unavailable
from collectives.groups import Group, generation_for
from collectives.ops.collectives import Collectives
from collectives.ops.data_plane import DataPlane
from collectives.session.connection import Session, server_timeout_s
from collectives.session.generation_binding import is_not_executed
from collectives.v1 import worker_pb2
from collectives.wire.op_args import check_pairs
from collectives.work import Work

__all__ = ["PeerToPeer"]


class PeerToPeer:
    """Point to point and group teardown; see :class:`Collectives` for the errors every
    op may raise."""

    def __init__(self, session: Session, collectives: Collectives, data_plane: DataPlane) -> None:
        self._session = session
        self._collectives = collectives
        self._data_plane = data_plane

    def send(
        self,
        name: str,
        src: int,
        dst: int,
        out: str | None = None,
        group: Group | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work[None] | None:
        """Global rank ``dst`` stores ``src``'s ``name``; ``src`` keeps its copy.

        One op, sequenced with the collectives.

        Args:
            name: the tensor name on ``src``.
            src: the global rank that sends.
            dst: the global rank that stores it.
            out: the name ``dst`` stores it under; None means ``name``.
                Defaults to ``None``.
            group: a ``Group`` both ranks belong to; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: ``src == dst``, a rank out of range or not in ``group``.
            NotFound: ``src`` holds no tensor under ``name``.
            ResourceExhausted: ``dst``'s store is over its quota, or the queue is full.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        return self._exchange("send", name, [(src, dst)], out, group, async_op, timeout)

    def exchange(
        self,
        name: str,
        pairs: list[tuple[int, int]],
        out: str | None = None,
        group: Group | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work[None] | None:
        """Every ``(src, dst)`` pair in one op, like ``batch_isend_irecv``.

        Each dst stores what its src held under ``name`` *before* the op, so a
        ring shift works in place. Sources may hold different dtypes and shapes;
        ranks named in no pair are untouched. Atomic: on failure no rank stores
        anything.

        Args:
            name: the tensor name on the sources.
            pairs: ``(src, dst)`` global ranks; each dst at most once.
            out: the name each dst stores under; None means ``name``.
                Defaults to ``None``.
            group: a ``Group`` every rank named belongs to; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: no pairs, ``src == dst``, a dst named twice, a rank out of
                range or not in ``group``.
            NotFound: no src holds ``name``.
            FailedPrecondition: some srcs lack ``name`` (the message names them).
            ResourceExhausted: a dst's store is over its quota, or the queue is full.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        return self._exchange("exchange", name, pairs, out, group, async_op, timeout)

    def destroy_group(self, group: Group, timeout: float | None = None) -> None:
        """Destroys ``group`` on every rank (``dist.destroy_process_group(group)``).

        It runs after this client's earlier ops; using the group afterwards
        raises NotFound.

        Args:
            group: a ``Group`` from :meth:`new_group`.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Raises:
            InvalidArgument: ``group`` is not a Group from ``new_group``.
            NotFound: the group does not exist (already destroyed, or from an older
                generation).
            Unavailable: the cluster is not formed or the leader was lost.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        if not isinstance(group, Group):
            raise InvalidArgument(
                "destroy_group needs a collectives.Group from Cluster.new_group, got "
                f"{type(group).__name__}; the world group cannot be destroyed"
            )
        deadline = self._session.deadline(timeout)
        what = f"destroy_group {list(group.ranks)} (id {group.id})"

        def attempt(remaining: float) -> None:
            snapshot = self._session.leader_snapshot(time.monotonic() + remaining)
            try:
                generation = generation_for(group, snapshot, what)
            except Unavailable as err:
                if err.executed is False:  # a handoff still running: retried
                    raise
                raise NotFound(
                    f"{what}: the group belongs to generation {group.generation} and the "
                    f"cluster is at generation {snapshot.generation}; it no longer exists"
                ) from None
            leader = snapshot.leader_address or ""
            options = worker_pb2.OpOptions(
                group_id=group.id,
                generation=generation,
                timeout_s=server_timeout_s(remaining),
                membership_digest=snapshot.digest_of(generation),
            )
            request = worker_pb2.DestroyGroupRequest(options=options)
            self._session.endpoint(leader).unary("DestroyGroup")(
                request, remaining, f"{what} on {leader}"
            )

        def run() -> None:
            self._session.retry(what, deadline, attempt, is_not_executed)
            self._data_plane.note_destroyed(group)

        self._session.ordered(what, run, deadline, async_op=False)

    def _exchange(
        self,
        kind: str,
        name: str,
        pairs: object,
        out: str | None,
        group: Group | None,
        async_op: bool,
        timeout: float | None,
    ) -> Work[None] | None:
        check_single(kind, name)
        out_name = check_out(out)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        members = list(group.ranks) if group is not None else None
        checked = check_pairs(pairs, self._session.formed_snapshot(deadline).world_size, members)
        wire = [worker_pb2.ExchangePair(src=s, dst=d) for s, d in checked]
        shown = f"{checked[0][0]} -> {checked[0][1]}" if kind == "send" else f"{checked}"
        return cast(
            "Work[None] | None",
            self._collectives.run_op(
                f"{kind} {name!r} {shown}",
                "Exchange",
                lambda o: worker_pb2.ExchangeRequest(
                    options=o, name=name, out=out_name, pairs=wire
                ),
                deadline,
                group,
                async_op,
            ),
        )
