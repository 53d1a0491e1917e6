"""``collectives.connect()`` and :class:`Cluster`, the SDK's one entry point.

A ``Cluster`` is a client's connection to one collectives cluster. It is built
by composition: a :class:`~collectives._session.ClusterSession` (the channel to
the coordinator, the membership view that follows it, a cached channel per
worker, deadlines, retries, the op order) and four parts that each take that
session: ``DataPlane`` (``_data_plane``: put/get/delete/scatter),
``Collectives`` (``_collectives``: broadcast ... new_group, with the coalesced
list forms), ``PeerToPeer`` (``_p2p``: send, exchange, destroy_group) and
``Models`` (``_models``; ``data_parallel`` builds on it). This class holds them
and keeps the flat public API, each method a one-line delegation, so
``help(cluster.all_reduce)`` is the reference.

A ``Cluster`` is safe to use from several threads. Its collectives reach the
leader in call order (they run on one executor thread), ``async_op=True``
included; data-plane calls run on the caller's thread, so, as with
``torch.distributed``, wait for an async op before reading or replacing the
tensors it works on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from collectives._collectives import Collectives
from collectives._data_plane import DataPlane
from collectives._models import ModelInfo, Models
from collectives._operations import Operations
from collectives._p2p import PeerToPeer
from collectives._session import DEFAULT_CONNECT_TIMEOUT_S, ClusterSession
from collectives.addresses import resolve_coordinator
from collectives.data_parallel import DataParallel
from collectives.flight_record import OpRecord
from collectives.groups import Group
from collectives.reduce_ops import ReduceOp
from collectives.wire.batching import Batching
from collectives.wire.cluster_state import ClusterSnapshot, GenerationRecord, WorkerInfo
from collectives.work import Work

__all__ = ["Cluster", "connect"]


class Cluster:
    """A connection to a collectives cluster; see :func:`connect`.

    ``Cluster(address, timeout)`` connects exactly like ``connect(address, timeout)``.
    Use it as a context manager, or call :meth:`close`.

    Conventions of every call: ``rank``, ``src`` and ``dst`` are global ranks of
    the current generation, also with ``group=``; ``out=None`` stores a result
    under the input name; results come back as CPU tensors; ``timeout`` (seconds)
    bounds the whole call, None meaning :attr:`default_timeout_s`;
    ``async_op=True`` returns a :class:`~collectives.Work` at once. Argument
    checks that need no server raise ``InvalidArgument`` before any RPC.
    """

    def __init__(
        self,
        address: str | None = None,
        timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        *,
        token: str | None = None,
        tls: bool | None = None,
        tls_ca: str | os.PathLike[str] | bytes | None = None,
        tls_cert: str | os.PathLike[str] | bytes | None = None,
        tls_key: str | os.PathLike[str] | bytes | None = None,
        shared_memory: bool | None = None,
        progress: bool | None = None,
        name: str | None = None,
    ) -> None:
        """Connects to the coordinator at ``address``; see :func:`connect`."""
        self._session = ClusterSession(
            resolve_coordinator(address),
            timeout,
            token=token,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            shared_memory=shared_memory,
            progress=progress,
            name=name,
        )
        self._data_plane = DataPlane(self._session)
        self._collectives = Collectives(self._session, self._data_plane)
        self._p2p = PeerToPeer(self._session, self._collectives, self._data_plane)
        self._models = Models(self._session, self._data_plane)
        self._operations = Operations(self._session)

    # --- the cluster view (no RPC) -------------------------------------------------

    @property
    def address(self) -> str:
        """The coordinator's ``host:port``."""
        return self._session.address

    @property
    def generation(self) -> int:
        """The latest generation the coordinator announced."""
        return self._session.snapshot().generation

    @property
    def world_size(self) -> int:
        """Number of ranks in the latest generation."""
        return self._session.snapshot().world_size

    @property
    def formed(self) -> bool:
        """True while a generation is sealed and enough members are alive."""
        return self._session.snapshot().formed

    @property
    def ready(self) -> bool:
        """True once every member joined the latest generation's process group."""
        return self._session.snapshot().ready

    @property
    def status(self) -> str:
        """The coordinator's human-readable status line."""
        return self._session.snapshot().status

    @property
    def leader(self) -> str | None:
        """Address of rank 0, which sequences every collective (None when not formed)."""
        return self._session.snapshot().leader_address

    @property
    def op_timeout_s(self) -> float:
        """The cluster's collective timeout (the servers' ``--op-timeout-s``)."""
        return self._session.snapshot().op_timeout_s

    @property
    def default_timeout_s(self) -> float:
        """Timeout of a call made without ``timeout=``: ``op_timeout_s`` plus a margin."""
        return self._session.default_timeout_s

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._session.closed

    def workers(self) -> list[WorkerInfo]:
        """Every registered worker: members in rank order, then joining/lost ones (rank -1).

        Reads the view the SDK keeps current by watching the coordinator; no RPC.

        Returns:
            One ``WorkerInfo`` per worker.
        """
        return list(self._session.snapshot().workers)

    def snapshot(self) -> ClusterSnapshot:
        """The whole latest cluster view (generation, status, workers, ...); no RPC.

        Returns:
            The ``ClusterSnapshot`` the background watch delivered last.
        """
        return self._session.snapshot()

    def history(self) -> list[GenerationRecord]:
        """Recent sealed generations, oldest first (time, size, members, reason); no RPC.

        Returns:
            One ``GenerationRecord`` per generation.
        """
        return list(self._session.snapshot().history)

    def refresh(self, timeout: float | None = None) -> ClusterSnapshot:
        """Asks the coordinator for the cluster now instead of waiting for the watch.

        Args:
            timeout: seconds to wait for the answer; None means 5 s. Defaults to ``None``.

        Returns:
            The coordinator's current ``ClusterSnapshot`` (also what the views show next).

        Raises:
            InvalidArgument: ``timeout`` is not a positive number.
            Unavailable: the coordinator does not answer, or the connection is closed.
            DeadlineExceeded: no answer within ``timeout`` seconds.
        """
        return self._session.refresh(timeout)

    # --- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        """Stops watching the coordinator and closes every channel; idempotent.

        Pending ``async_op`` calls that have not started are cancelled (their
        ``Work`` raises ``Unavailable``). A call in flight on another thread ends
        at once with ``Unavailable`` ("the cluster handle was closed"), never
        ``DeadlineExceeded``: nothing timed out, and a retry cannot succeed.
        """
        self._session.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._session.closed:
            return f"<Cluster {self._session.address} closed>"
        return f"<Cluster {self._session.address} {self._session.describe()}>"

    # --- placing tensors (data plane) ----------------------------------------------

    def put(
        self, name: str, t: torch.Tensor, rank: int | None = None, timeout: float | None = None
    ) -> None:
        """Stores ``t`` under ``name`` on ``rank``, or on every rank when ``rank`` is None.

        A tensor already stored under the name is replaced; the tensor is sent
        as-is (dtype, shape). With ``rank=None`` on two or more ranks, a tensor of
        at least 4 MiB is sent once, to the leader, and the workers broadcast it
        among themselves (a sequenced op: every rank stores it, or, if it fails
        anywhere, e.g. over some rank's quota, none does and every old value
        stays); smaller tensors, and a client using shared memory with same-host
        workers, upload to every rank in parallel. Retried within the deadline.

        Args:
            name: the tensor's name on the workers.
            t: the tensor to store (any device; sent as a CPU copy).
            rank: the global rank to store it on; None means every rank.
                Defaults to ``None``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Raises:
            InvalidArgument: bad name, rank, tensor type or dtype (before any RPC).
            ResourceExhausted: a worker's tensor store is over its quota.
            Unavailable: a worker stayed unreachable (retried until the deadline).
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        return self._data_plane.put(name, t, rank, timeout)

    def get(
        self,
        name: str,
        rank: int = 0,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Downloads the tensor stored under ``name`` on ``rank``.

        With ``out`` the bytes are received straight into it: no new memory,
        which for large tensors saves the page faults of a fresh buffer (a
        model's parameter, or the buffer of the previous get). If the get fails
        after data started to arrive, ``out`` holds a mix of old and new bytes.

        Args:
            name: the tensor's name on the workers.
            rank: the global rank to read from. Defaults to ``0``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            out: a contiguous CPU tensor of the stored dtype and shape that does
                not require grad, to receive into. Defaults to ``None``.

        Returns:
            A CPU tensor of the stored dtype and shape (``out`` itself when given).

        Raises:
            InvalidArgument: bad name or rank (before any RPC), or ``out`` does not
                fit (``out`` is then left as it was).
            NotFound: ``rank`` holds no tensor under ``name``.
            Unavailable: the worker stayed unreachable (retried until the deadline).
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        return self._data_plane.get(name, rank, timeout, out)

    def delete(
        self,
        name: str,
        rank: int | None = None,
        missing_ok: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Deletes ``name`` on ``rank``, or wherever it exists when ``rank`` is None.

        Args:
            name: the tensor's name on the workers.
            rank: the global rank to delete it on; None means every rank.
                Defaults to ``None``.
            missing_ok: do not raise when no targeted rank holds the name.
                Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Raises:
            InvalidArgument: bad name or rank (before any RPC).
            NotFound: the name exists on none of the targeted ranks (unless ``missing_ok``).
            Unavailable: a worker stayed unreachable (retried until the deadline).
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        return self._data_plane.delete(name, rank, missing_ok, timeout)

    def scatter(
        self,
        name: str,
        t: torch.Tensor,
        dim: int = 0,
        chunk_sizes: list[int] | None = None,
        timeout: float | None = None,
        group: Group | None = None,
        async_op: bool = False,
    ) -> Work[None] | None:
        """Stores part i of ``t`` under ``name`` on rank i; uploads run in parallel.

        Part i is ``torch.tensor_split(t, n, dim)[i]``, or ``torch.split(t,
        chunk_sizes, dim)[i]`` when ``chunk_sizes`` is given, with ``n`` the world
        size; with ``group``, ``n`` is the group's size and part i goes to its i-th
        member in ascending global rank (other ranks are untouched). A data-plane
        call, not a collective.

        Args:
            name: the name every part is stored under.
            t: the tensor to split.
            dim: the dimension to split along. Defaults to ``0``.
            chunk_sizes: the size of each part along ``dim`` (``n`` of them, summing
                to ``t.shape[dim]``); None splits evenly. Defaults to ``None``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            group: a ``Group`` from :meth:`new_group`; None means every rank.
                Defaults to ``None``.
            async_op: return a ``Work`` at once (after the arguments are checked)
                and run in this client's op order, as the collectives do; ``t``
                must not change until it completes. Defaults to ``False``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: bad name, tensor, ``dim``, or ``chunk_sizes`` whose
                length is not ``n`` or whose sum is not ``t.shape[dim]``.
            NotFound: ``group`` was destroyed.
            ResourceExhausted: a worker's tensor store is over its quota.
            Unavailable: a worker stayed unreachable (retried until the deadline), or
                ``group`` belongs to an older generation.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        return self._data_plane.scatter(name, t, dim, chunk_sizes, timeout, group, async_op)

    # --- collectives ---------------------------------------------------------------
    # Every collective may also raise Unavailable (a rank was lost, the generation
    # changed, the cluster is not formed), DeadlineExceeded and ResourceExhausted
    # (the leader's op queue is full, or a result would exceed a worker's quota).

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
            InvalidArgument: ``out`` was given, or a bad name, ``src`` or group.
            NotFound: ``src`` holds no tensor under ``name``.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        return self._collectives.broadcast(name, src, group, async_op, timeout, out)

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
        return self._collectives.all_reduce(name, op, group, out, async_op, timeout)

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
            The reduction as a CPU tensor, or a ``Work`` of it with ``async_op``.

        Raises:
            InvalidArgument: a list of names, or a bad name, ``dst``, op or group.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        return self._collectives.reduce(name, dst, op, group, out, async_op, timeout)

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
            parts per name, in order), or a ``Work`` of that with ``async_op``.

        Raises:
            InvalidArgument: a bad name, ``out`` or group.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        return self._collectives.all_gather(name, out, group, async_op, timeout)

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
            The parts as CPU tensors in rank order, or a ``Work`` of them with ``async_op``.

        Raises:
            InvalidArgument: a list of names, or a bad name, ``dst``, ``out`` or group.
            NotFound: no rank holds ``name``.
            FailedPrecondition: some ranks lack ``name`` or disagree on dtype/shape.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
            ResourceExhausted: the leader's op queue is full, or over a quota.
        """
        return self._collectives.gather(name, dst, out, group, async_op, timeout)

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
        return self._collectives.reduce_scatter(name, op, out, group, async_op, timeout)

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
        return self._collectives.all_to_all(name, out, group, async_op, timeout, split_sizes)

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
        return self._collectives.barrier(group, async_op, timeout)

    def new_group(self, ranks: list[int], timeout: float | None = None) -> Group:
        """Creates a sub-group of the current generation from global ``ranks``.

        The group is valid until the generation changes; create it again then.

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
        return self._collectives.new_group(ranks, timeout)

    # --- point to point ------------------------------------------------------------

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
        return self._p2p.send(name, src, dst, out, group, async_op, timeout)

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
        return self._p2p.exchange(name, pairs, out, group, async_op, timeout)

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
        return self._p2p.destroy_group(group, timeout)

    # --- operations ----------------------------------------------------------------

    def flight_record(
        self, last: int = 100, ranks: Sequence[int] | None = None, timeout: float | None = None
    ) -> list[OpRecord]:
        """The last ``last`` ops of every rank's flight recorder, merged by op.

        Every worker keeps its recent ops (``--flight-recorder-ops``, default 2000)
        with the time each reached each phase: ``admitted`` (leader), ``announced``,
        ``started`` (operands agreed, data moving) and ``finished``. The leader
        sequences every op, so one op has one ``(generation, op_id)`` on every rank.

        Args:
            last: how many of the most recent ops (0: all the rings hold). Defaults
                to ``100``.
            ranks: read only these ranks (None: every member). Defaults to ``None``.
            timeout: seconds for the coordinator and for each rank's answer (a
                rank answers a large ring in pages, all within it); None means
                ``default_timeout_s``. Defaults to ``None``.

        Returns:
            One ``collectives.OpRecord`` per op, oldest first: ``op_id``,
            ``generation``, ``kind``, ``names`` (an op's first 16; ``names_omitted``
            counts the rest), ``nbytes``, ``ranks``, ``client``, ``outcome`` and
            ``per_rank`` (rank -> ``RankPhases``: phase times in Unix seconds, that
            rank's outcome and message, at most 1,024 characters). A rank that did
            not answer is absent from ``per_rank``.

        Raises:
            InvalidArgument: ``last`` is negative, or ``ranks`` names a non-member.
            Unavailable: the coordinator, or every rank asked, could not be reached.
        """
        return self._operations.flight_record(last, ranks, timeout)

    # --- models --------------------------------------------------------------------

    def load_model(
        self,
        name: str,
        module: nn.Module | None = None,
        example_inputs: Any = None,
        *,
        factory: str | None = None,
        kwargs: dict[str, Any] | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        timeout: float | None = None,
        batching: Batching | None = None,
        batch_dim: int = 0,
    ) -> ModelInfo:
        """Loads a model on every worker, replacing one of the same name.

        Either ``module`` with ``example_inputs`` (shipped as a torch.export
        archive with dimension ``batch_dim`` of every tensor input dynamic, the
        rest fixed at the example's sizes; one of 4 MiB or more on two or more
        workers is sent once and broadcast among them, a smaller one streamed
        to each worker), or ``factory`` with JSON ``kwargs``.

        Args:
            name: the model's name on the cluster.
            module: the ``nn.Module`` to export and ship. Defaults to ``None``.
            example_inputs: inputs to export ``module`` with (a tuple, or one
                input). Defaults to ``None``.
            factory: ``"pkg.module:fn"`` building the model on each worker (the
                workers must allow it with ``--allow-factory``). Defaults to ``None``.
            kwargs: JSON-serializable keyword arguments of ``factory``.
                Defaults to ``None``.
            state_dict: weights to publish after loading (tensors, never pickle;
                the model is then at version 2). Defaults to ``None``.
            timeout: seconds for the whole call (export, upload, load); None
                means ``default_timeout_s`` plus ``MODEL_LOAD_TIMEOUT_S``, the
                time a worker gives one load by default (a sandboxed trial load
                starts a Python that imports torch). Defaults to ``None``.
            batching: merge concurrent no-grad forwards of this model, from any
                clients, into one forward on each worker
                (``Batching(max_rows=256, max_delay_ms=2.0)``); forwards with
                autograd or in training mode are never merged; None: each
                forward runs alone. Defaults to ``None``.
            batch_dim: the dimension of ``module``'s inputs that
                ``data_parallel(name, dim=batch_dim)`` splits (negative counts
                from the end); a factory's model is not exported and takes any.
                Defaults to ``0``.

        Returns:
            The ``ModelInfo`` rank 0 reports.

        Raises:
            InvalidArgument: the module cannot be exported, bad arguments (a
                ``batch_dim`` that is not an int), or a ``batching`` that is not
                a ``Batching``.
            PermissionDenied: the factory is not allowed on the workers.
            CollectiveError: a worker refused the model or the call failed.
        """
        return self._models.load_model(
            name,
            module,
            example_inputs,
            factory=factory,
            kwargs=kwargs,
            state_dict=state_dict,
            timeout=timeout,
            batching=batching,
            batch_dim=batch_dim,
        )

    def unload_model(
        self, name: str, missing_ok: bool = False, timeout: float | None = None
    ) -> None:
        """Unloads a model from every worker.

        Args:
            name: the model.
            missing_ok: do not raise when no worker has it. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Raises:
            InvalidArgument: a bad model name.
            NotFound: no worker had it (unless ``missing_ok``).
            CollectiveError: a worker failed or the call timed out.
        """
        return self._models.unload_model(name, missing_ok, timeout)

    def models(self, timeout: float | None = None) -> list[ModelInfo]:
        """Models loaded on the cluster (as rank 0 holds them).

        Args:
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            One ``ModelInfo`` per model.

        Raises:
            CollectiveError: rank 0 failed or the call timed out.
        """
        return self._models.models(timeout)

    def set_model_mode(
        self, name: str, training: bool = True, timeout: float | None = None
    ) -> ModelInfo:
        """Sets the mode model ``name`` runs in on every worker, like ``nn.Module.train``.

        In train mode dropout is on and batch norm normalises each shard with its
        own statistics (updating that worker's running ones, as each replica of
        ``nn.DataParallel`` does); in eval mode neither. ``DataParallel.train()``
        and ``eval()`` call this.

        Args:
            name: the model.
            training: True for train mode, False for eval mode. Defaults to ``True``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            The model as rank 0 holds it now (``training`` says its mode).

        Raises:
            NotFound: the model is not loaded.
            FailedPrecondition: the model's exported graph holds a mode-dependent
                operator that cannot be switched (export it in the mode to run).
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        return self._models.set_model_mode(name, training, timeout)

    def data_parallel(self, name: str, dim: int = 0, timeout: float | None = None) -> DataParallel:
        """A callable that runs model ``name`` data-parallel over the workers.

        Args:
            name: the model.
            dim: the dimension inputs are split and outputs gathered along (a
                module loaded with ``load_model`` must have been loaded with
                ``batch_dim=dim``). Defaults to ``0``.
            timeout: seconds for each call of the callable; None means
                ``default_timeout_s``. Defaults to ``None``.

        Returns:
            A ``DataParallel`` (no RPC until it is called).

        Raises:
            InvalidArgument: a bad model name.
        """
        return DataParallel(self._session, self._models, name, dim=dim, timeout=timeout)

    def all_reduce_gradients(
        self,
        name: str,
        op: str | ReduceOp = "sum",
        bucket_bytes: int | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """All-reduces every parameter's gradient in coalesced buckets (default 25 MiB).

        One collective per bucket; afterwards every replica holds bit-identical
        gradients. A worker that got no shard contributes zeros. After ``loss =
        f(dp(x)); loss.backward()`` (a loss over the whole gathered batch) the
        workers' parts *add up* to the full-batch gradient: ``"sum"`` is right,
        and this client refuses ``"avg"`` until ``zero_grad``, ``train_step`` or a
        ``"sum"``. ``"avg"`` is for gradients of per-worker mean losses (what DDP
        averages).

        Args:
            name: the model.
            op: ``"sum"`` or ``"avg"`` (or the ``ReduceOp``). Defaults to ``"sum"``.
            bucket_bytes: the bucket size in bytes; None means 25 MiB.
                Defaults to ``None``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: ``op`` is not sum/avg, ``"avg"`` on gradients this
                client computed with a DataParallel backward, or a bad bucket size.
            NotFound: the model is missing on every rank.
            FailedPrecondition: the model is missing on some ranks.
        """
        return self._models.all_reduce_gradients(name, op, bucket_bytes, timeout, async_op)

    def train_step(
        self,
        name: str,
        inputs: str,
        targets: str,
        loss: str | nn.Module | Callable[..., torch.Tensor] = "mse",
        optimizer: str | None = None,
        bucket_bytes: int | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        *,
        max_grad_norm: float | None = None,
        **hyper: Any,
    ) -> Any:
        """A DDP-style step on data already on the workers.

        Every worker computes ``loss`` (mean over its shard) of the model on the
        tensors named ``inputs``/``targets`` in its store, backpropagates, and
        the gradients are averaged across workers (bucketed); with ``optimizer``
        each worker then steps.

        Args:
            name: the model.
            inputs: the name of the input tensor in each worker's store.
            targets: the name of the target tensor in each worker's store.
            loss: a built-in loss name (``"mse"``, ``"cross_entropy"``), or your
                own: an ``nn.Module`` or a function of ``(output, target)``
                returning one number, exported with ``torch.export`` (traced on
                tensors shaped like the model's output on rank 0's shard and its
                targets) and loaded on every worker once. Defaults to ``"mse"``.
            optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"`` to step after the
                reduction; None means no step. Defaults to ``None``.
            bucket_bytes: the gradient bucket size in bytes; None means 25 MiB.
                Defaults to ``None``.
            timeout: seconds for the whole call; None means ``default_timeout_s``
                (after a first load of a ``loss`` module, which allows
                ``MODEL_LOAD_TIMEOUT_S`` as ``load_model`` does). Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            max_grad_norm: clip the averaged gradients to this total 2-norm
                before the step, as ``clip_grad_norm_``; None means no clipping.
                Defaults to ``None``.
            **hyper: the optimizer's hyperparameters (JSON numbers), e.g. ``lr``.

        Returns:
            The global loss, or a ``Work`` of it with ``async_op``.

        Raises:
            InvalidArgument: an unknown loss, optimizer or hyperparameter, or a bad name.
            NotFound: the model or a tensor is missing.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        return self._models.train_step(
            name,
            inputs,
            targets,
            loss,
            optimizer,
            bucket_bytes,
            timeout,
            async_op,
            max_grad_norm=max_grad_norm,
            **hyper,
        )

    def step(
        self,
        name: str,
        optimizer: str = "sgd",
        timeout: float | None = None,
        *,
        max_grad_norm: float | None = None,
        **hyper: Any,
    ) -> None:
        """Steps the optimizer of model ``name`` on every worker (state kept per worker).

        A different optimizer kind than before starts fresh state; other
        hyperparameters (``lr`` each step, for a schedule) keep it.

        Args:
            name: the model.
            optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``. Defaults to ``"sgd"``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            max_grad_norm: clip each worker's gradients to this total 2-norm
                before stepping; None means no clipping. Defaults to ``None``.
            **hyper: the optimizer's hyperparameters (JSON numbers), e.g. ``lr``.

        Raises:
            InvalidArgument: unknown optimizer or hyperparameter, or a
                ``max_grad_norm`` that is not a positive number.
            NotFound: the model is not loaded.
            CollectiveError: a worker failed or the call timed out.
        """
        return self._models.step(name, optimizer, timeout, max_grad_norm=max_grad_norm, **hyper)

    def apply(
        self,
        fn: nn.Module | Callable[..., Any],
        inputs: str | Sequence[str],
        out: str | Sequence[str],
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Runs ``fn`` on the tensors named ``inputs`` on each rank; stores its outputs as ``out``.

        ``fn`` never travels as Python: it is exported with ``torch.export``
        (traced on tensors shaped like the first target rank's inputs,
        dimension 0 dynamic) and the workers check and load the program as
        they do a model's, once per function and input signature. It runs
        without autograd, in parallel, each rank on its own tensors.

        Args:
            fn: an ``nn.Module`` or a function of tensors returning a tensor or
                a tuple of tensors; it must be exportable.
            inputs: the name, or names in order, of the tensors passed to ``fn``.
            out: one name per output tensor; tensors of those names are
                replaced, all of a rank's outputs or none.
            ranks: the global ranks to run on; None means every member.
                Defaults to ``None``.
            timeout: seconds for the whole call (export, load, run); None
                means ``default_timeout_s`` for the run, after a first load of
                ``fn`` that allows ``MODEL_LOAD_TIMEOUT_S`` as ``load_model``
                does. Defaults to ``None``.

        Raises:
            InvalidArgument: a bad name or rank, ``fn`` cannot be exported, the
                workers refused its program (an operator off their allowlist),
                it failed on a rank's tensors, or it returned another number
                of tensors than ``out`` names.
            NotFound: an input is missing on a rank.
            ResourceExhausted: the outputs do not fit a rank's memory quota.
            CollectiveError: a worker failed or the call timed out.
        """
        return self._models.apply(fn, inputs, out, ranks, timeout)

    def zero_grad(self, name: str, timeout: float | None = None) -> None:
        """Clears every parameter's gradient (sets it to None) on every worker.

        Args:
            name: the model.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Raises:
            NotFound: the model is not loaded.
            CollectiveError: a worker failed or the call timed out.
        """
        return self._models.zero_grad(name, timeout)

    def gradients(
        self, name: str, rank: int = 0, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Parameters with a gradient on ``rank``, keyed like ``named_parameters()``.

        Args:
            name: the model.
            rank: the global rank to read from. Defaults to ``0``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            Parameter name to gradient (CPU tensors).

        Raises:
            InvalidArgument: ``rank`` is out of range.
            NotFound: the model is not loaded.
            CollectiveError: the worker failed or the call timed out.
        """
        return self._models.gradients(name, rank, timeout)

    def state_dict(
        self, name: str, rank: int = 0, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` on ``rank``.

        Args:
            name: the model.
            rank: the global rank to read from. Defaults to ``0``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            Key to tensor (CPU tensors).

        Raises:
            InvalidArgument: ``rank`` is out of range.
            NotFound: the model is not loaded.
            CollectiveError: the worker failed or the call timed out.
        """
        return self._models.state_dict(name, rank, timeout)

    def publish(
        self,
        name: str,
        state_dict: dict[str, torch.Tensor],
        *,
        strict: bool = True,
        cast: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Publishes new weights for model ``name``.

        The client sends each byte once (to the leader); the workers broadcast
        the weights among themselves, stage them beside the live ones and switch
        at one point of the op order, on every rank or on none. A ``dp(x)``
        running meanwhile finishes on the version it started with, and no output
        mixes two versions.

        Args:
            name: the model.
            state_dict: key to tensor, as ``nn.Module.state_dict()``.
            strict: every key of the model must be given; False takes any subset
                (the others keep their values). Defaults to ``True``.
            cast: convert entries whose dtype differs from the model's (otherwise
                refused). Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            The version every rank now serves.

        Raises:
            InvalidArgument: unknown or missing keys, a shape or dtype mismatch, an
                empty state dict.
            NotFound: the model is missing on every rank.
            FailedPrecondition: the model is missing on some ranks.
            ResourceExhausted: quota, or retained graphs of an older version still
                hold it (at most two versions are resident): run their backward or
                drop their outputs, then publish again.
        """
        return self._models.publish(name, state_dict, strict=strict, cast=cast, timeout=timeout)

    def load_state_dict(
        self,
        name: str,
        state_dict: dict[str, torch.Tensor],
        timeout: float | None = None,
        *,
        strict: bool = True,
        cast: bool = False,
    ) -> int:
        """Loads ``state_dict`` into the model on every worker: :meth:`publish` under
        the name ``nn.Module`` uses.

        Args:
            name: the model.
            state_dict: key to tensor, as ``nn.Module.state_dict()``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            strict: every key of the model must be given; False takes any subset.
                Defaults to ``True``.
            cast: convert entries whose dtype differs from the model's.
                Defaults to ``False``.

        Returns:
            The new version.

        Raises:
            InvalidArgument: unknown or missing keys, or a shape or dtype mismatch.
            NotFound: the model is missing on every rank.
            ResourceExhausted: quota, or too many versions resident (see :meth:`publish`).
        """
        return self._models.load_state_dict(name, state_dict, timeout, strict=strict, cast=cast)


def connect(
    address: str | None = None,
    timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    *,
    token: str | None = None,
    tls_ca: str | os.PathLike[str] | bytes | None = None,
    tls_cert: str | os.PathLike[str] | bytes | None = None,
    tls_key: str | os.PathLike[str] | bytes | None = None,
    tls: bool | None = None,
    shared_memory: bool | None = None,
    progress: bool | None = None,
    name: str | None = None,
) -> Cluster:
    """Connects to the coordinator at ``host:port`` and waits until a generation is formed.

    Example::

        with collectives.connect("127.0.0.1:50051") as cluster:
            cluster.put("x", torch.ones(4))
            cluster.all_reduce("x")

    ``address`` None (``collectives.connect()``) reads ``COLLECTIVES_COORDINATOR``,
    the variable the ``collectives`` commands read for ``--coordinator``.

    Security (see ``docs/security.md``): ``token`` is sent as ``authorization:
    Bearer <token>`` on every call; ``tls_ca`` (PEM path or bytes) verifies the
    servers' certificates and turns TLS on (``tls=True`` alone: TLS with the
    system roots); ``tls_cert``/``tls_key`` are a client certificate for mutual
    TLS. Each falls back to ``COLLECTIVES_TOKEN``, ``COLLECTIVES_TLS_CA``,
    ``COLLECTIVES_TLS_CERT``, ``COLLECTIVES_TLS_KEY`` (and ``COLLECTIVES_TLS=1``)
    when None: argument > environment > none.

    ``shared_memory=True`` (or ``COLLECTIVES_SHM=1`` when None) lets ``put`` and
    ``get`` move payloads through ``/dev/shm`` instead of the gRPC stream, for
    workers on this host reached over loopback (same hostname, 127.x/::1/
    localhost address); other workers, or a worker that refuses it, get the
    stream. Each segment is unlinked as soon as the call is done.

    ``progress`` (or ``COLLECTIVES_PROGRESS`` when None): puts, gets, model
    loads and state-dict loads of 256 MiB or more draw a progress bar on stderr
    when it is a terminal; False (``COLLECTIVES_PROGRESS=0``) never draws one,
    True (``=1``) draws one even when stderr is not a terminal.

    ``name`` (or ``COLLECTIVES_CLIENT_NAME`` when None) names this client to
    operators: the workers list it among their clients, and on the errors of
    the ops it issued, in ``collectives top``, ``status`` and the dashboard.

    Raises:
        InvalidArgument: ``address`` is None and ``COLLECTIVES_COORDINATOR`` is
            unset or empty; ``address`` or ``timeout`` is malformed, a TLS or
            token setting is unreadable or inconsistent, or ``address`` is not
            a coordinator: a worker (the message names its coordinator) or an
            HTTP port such as the dashboard's.
        Unavailable: nothing answers at ``address`` within ``timeout`` seconds
            (also: a plaintext client against a TLS server, an untrusted certificate).
        PermissionDenied: the server requires a token and got none or a wrong one.
        DeadlineExceeded: the coordinator answers but no generation was formed
            within ``timeout`` seconds (the message quotes its status).
    """
    return Cluster(
        address,
        timeout,
        token=token,
        tls=tls,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
        shared_memory=shared_memory,
        progress=progress,
        name=name,
    )
