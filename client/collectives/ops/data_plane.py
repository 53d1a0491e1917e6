"""Data placement: ``put``, ``get``, ``delete`` and ``scatter`` of named tensors.

Bulk data goes straight to the worker holding each rank, over that worker's own
channel, in parallel across ranks; nothing passes through the coordinator. The
one exception is a large ``put`` on every rank: sent once to the leader, which
broadcasts it to the other workers (``_replicate``), so the client sends each
byte once. All four calls are idempotent, so each rank's call is retried on
``UNAVAILABLE`` after refreshing the cluster (which re-resolves rank to
address), within the call's deadline.

:class:`DataPlane` is the part of ``Cluster`` that makes these calls, over a
:class:`~collectives.session.connection.Session`; the collectives use its ``get_rank`` to
download their results.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import torch

from collectives._progress import Deferred, Progress, progress
from collectives._validation import (
    check_group,
    check_name,
    check_rank,
    check_tensor,
    scatter_parts,
)
from collectives.errors import (
    CollectiveError,
    InvalidArgument,
    NotFound,
    annotate,
)
from collectives.groups import Group, generation_for
from collectives.ops.replicate import REPLICATE_MIN_BYTES, UseParallelPuts, replicate
from collectives.session.connection import Session
from collectives.transport import shm
from collectives.transport.calls import Job
from collectives.transport.endpoints import (
    WorkerEndpoint,
    get_tensor,
    get_tensor_shm,
    is_retryable_read,
    put_tensor,
    put_tensor_shm,
)
from collectives.transport.roads import DataPath, choose_path
from collectives.v1 import worker_pb2
from collectives.wire import codec
from collectives.wire.names import UPLOAD_PREFIX, reserved_prefix
from collectives.work import Work

__all__ = ["DataPlane"]

R = TypeVar("R")


class DataPlane:
    """``put``, ``get``, ``delete`` and ``scatter`` over one session (see the module)."""

    def __init__(self, session: Session) -> None:
        self._session = session
        # Worker addresses that refused shared memory (UNIMPLEMENTED, not loopback): stream.
        self._shm_refused: set[str] = set()
        # (generation, id) of the groups this client destroyed: the calls the SDK runs
        # itself (a group scatter) refuse them as the leader refuses the others.
        self._destroyed_groups: set[tuple[int, int]] = set()

    def put(
        self, name: str, t: torch.Tensor, rank: int | None = None, timeout: float | None = None
    ) -> None:
        """Stores ``t`` under ``name`` on ``rank``, or on every rank when ``rank`` is None.

        A tensor already stored under the name is replaced; the tensor is sent
        as-is (dtype, shape).

        With ``rank=None`` on two or more ranks, a tensor of at least 4 MiB is
        sent **once**, to the leader, and the workers broadcast it among
        themselves in one sequenced op: the client's egress is the tensor's
        bytes, not the world size times them, and the put is atomic: every rank
        stores it, or, if it fails anywhere (a rank over its quota, a lost
        worker), none does and every rank keeps its old value. A ``get`` on any
        rank after the call returns sees the new value. Smaller tensors, and
        puts from a ``shared_memory=True`` client to same-host workers, upload
        to every rank in parallel (a rank's failure there leaves the others
        updated). A tensor that fits in the leader's quota only in place of its
        old value (the upload waits beside it) takes the parallel path too.

        Like every put, it is retried within the deadline (the sent-once put
        uploads again to whichever worker leads after a membership change).

        Args:
            name: the tensor's name on the workers.
            t: the tensor to store (any device; sent as a CPU copy).
            rank: the global rank to store it on; None means every rank.
                Defaults to ``None``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Raises:
            InvalidArgument: bad name, rank, tensor type or dtype, or a name under
                a prefix reserved for uploads (``__publish/``, ``__archive/``);
                before any RPC.
            ResourceExhausted: a worker's tensor store is over its quota (for the
                sent-once put the message names the ranks, and nothing was stored).
            Unavailable: a worker stayed unreachable (retried until the deadline).
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        check_name(name)
        reserved = reserved_prefix(name)
        if reserved is not None:
            raise InvalidArgument(
                f"tensor names under {reserved!r} are reserved for "
                f"{'publish' if reserved == UPLOAD_PREFIX else 'load_model'}'s uploads"
            )
        check_tensor(t)
        deadline = self._session.deadline(timeout)
        ranks = self._target_ranks(rank, deadline)
        use_shm = self.shm_wanted(ranks, deadline)
        # One CPU copy shared by all uploads (and the shared-memory segment).
        wire = codec.wire_tensor(t) if len(ranks) > 1 or use_shm else t
        nbytes = wire.numel() * wire.element_size()
        if rank is None and len(ranks) > 1 and not use_shm and nbytes >= REPLICATE_MIN_BYTES:
            try:
                with progress(f"put {name!r}", nbytes, self._session.progress) as bar:
                    replicate(self._session, name, wire, deadline, bar)
                return
            except UseParallelPuts:
                ranks = self._target_ranks(rank, deadline)  # as below, every rank in parallel
        segment = None
        if use_shm:
            segment = self._session.shm_pool.acquire(nbytes)
        # One bar for the whole call: every rank's bytes.
        bar = progress(f"put {name!r}", nbytes * len(ranks), self._session.progress)
        answered = False
        try:
            if segment is not None:
                segment.write(wire)
            # A put to one worker may leave the tensor in the segment (hand it over).
            hand_over = len(ranks) == 1
            self._session.fan_out(
                f"put {name!r}",
                {
                    r: self._rank_call(
                        r, deadline, f"put {name!r}", self._put(name, wire, segment, bar, hand_over)
                    )
                    for r in ranks
                },
            )
            answered = True
        finally:
            bar.close()
            if segment is not None:
                if answered:
                    self._session.shm_pool.release(segment)
                else:  # a rank that failed may still be reading it: never reuse it
                    self._session.shm_pool.discard(segment)

    def get(
        self,
        name: str,
        rank: int = 0,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Downloads the tensor stored under ``name`` on ``rank``.

        The result is a CPU tensor of the stored dtype and shape. With ``out``
        the bytes are received straight into it and ``out`` is returned: no new
        memory, which for large tensors saves the page faults of a fresh buffer
        (pull weights into a model's parameters, or reuse the buffer of the
        previous get). If the get fails once data has started to arrive, ``out``
        holds a mix of old and new bytes.

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
        check_name(name)
        if out is not None:
            codec.check_out(out)
        deadline = self._session.deadline(timeout)
        rank = check_rank(rank, self._session.formed_snapshot(deadline).world_size)
        return self.get_rank(name, rank, deadline, out)

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
        check_name(name)
        deadline = self._session.deadline(timeout)
        ranks = self._target_ranks(rank, deadline)
        what = f"delete {name!r}"

        def delete_on(endpoint: WorkerEndpoint, remaining: float) -> bool:
            request = worker_pb2.DeleteTensorRequest(name=name, missing_ok=True)
            response = endpoint.unary("DeleteTensor")(request, remaining, what)
            return bool(response.deleted)

        deleted = self._session.fan_out(
            what, {r: self._rank_call(r, deadline, what, delete_on) for r in ranks}
        )
        if not missing_ok and not any(deleted.values()):
            where = f"rank {ranks[0]}" if rank is not None else f"any of ranks {ranks}"
            raise NotFound(
                f"tensor {name!r} does not exist on {where}; pass missing_ok=True to ignore"
            )

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

        Part i is ``torch.tensor_split(t, n, dim)[i]``, or
        ``torch.split(t, chunk_sizes, dim)[i]`` when ``chunk_sizes`` is given, with
        ``n`` the world size; with ``group``, ``n`` is the group's size and part i
        goes to its i-th member in ascending global rank (other ranks are
        untouched). A data-plane call (uploads from the client in parallel), not
        a collective.

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
            NotFound: this client destroyed ``group`` (scatter is this client's puts
                to the group's ranks: a group another client destroyed is not
                asked of the cluster, and its ranks get their parts).
            ResourceExhausted: a worker's tensor store is over its quota.
            Unavailable: a worker stayed unreachable (retried until the deadline), or
                ``group`` belongs to an older generation.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        check_name(name)
        check_tensor(t)
        group = check_group(group)
        deadline = self._session.deadline(timeout)
        snapshot = self._session.formed_snapshot(deadline)
        if group is None:
            ranks, of = list(range(snapshot.world_size)), "the world size"
        else:
            ranks, of = self._group_members(group, snapshot.generation), "the group size"
        parts = scatter_parts(codec.wire_tensor(t), len(ranks), dim, chunk_sizes, of)
        what = f"scatter {name!r}"
        total = sum(p.numel() * p.element_size() for p in parts)

        def run() -> None:
            with progress(what, total, self._session.progress) as bar:
                self._session.fan_out(
                    what,
                    {
                        r: self._rank_call(r, deadline, what, _put_stream(name, p, bar))
                        for r, p in zip(ranks, parts, strict=True)
                    },
                )

        if not async_op:
            run()
            return None
        return self._session.ordered(what, run, deadline, async_op=True)

    def note_destroyed(self, group: Group) -> None:
        """``destroy_group(group)`` ran: this client's own group calls refuse it from now on."""
        self._destroyed_groups.add((group.generation, group.id))

    def _group_members(self, group: Group, generation: int) -> list[int]:
        """``group``'s global ranks, for the calls the SDK runs itself (scatter).

        Raises:
            NotFound: this client destroyed the group.
            Unavailable: the group belongs to an older generation.
        """
        if (group.generation, group.id) in self._destroyed_groups:
            raise NotFound(
                f"group {list(group.ranks)} (id {group.id}) was destroyed; create it again "
                "with new_group"
            )
        generation_for(group, self._session.snapshot(), f"group {list(group.ranks)}")
        return list(group.ranks)

    # --- helpers -------------------------------------------------------------

    def _target_ranks(self, rank: int | None, deadline: float) -> list[int]:
        world_size = self._session.formed_snapshot(deadline).world_size
        if rank is None:
            return list(range(world_size))
        return [check_rank(rank, world_size)]

    def get_rank(
        self,
        name: str,
        rank: int,
        deadline: float,
        out: torch.Tensor | None = None,
        result_of: worker_pb2.ResultOf | None = None,
    ) -> torch.Tensor:
        """Downloads ``name`` from ``rank`` (retried within ``deadline``); see :meth:`get`.
        ``result_of``: the op whose result this reads back (refused if written over)."""
        what = f"get {name!r}"

        def get_on(endpoint: WorkerEndpoint, remaining: float) -> torch.Tensor:
            shared = self._shm_ok(endpoint.address)
            route = choose_path(endpoint, remaining, nbytes=None, shared_memory=shared)
            if route.path is DataPath.SHM:
                try:
                    mapped = get_tensor_shm(
                        endpoint, name, remaining, self._session.shm_pool, result_of=result_of
                    )
                except CollectiveError as err:
                    if not self._shm_refused_by(endpoint.address, err):
                        raise
                else:
                    return mapped if out is None else _copied_out(name, mapped, out)
                route = choose_path(endpoint, remaining, nbytes=None)  # refused: not shm
            return get_tensor(
                endpoint,
                name,
                remaining,
                route=route,
                progress=bar.start,
                out=out,
                result_of=result_of,
            )

        # A bar once the size is known (shared memory: none, it is one copy).
        with Deferred(what, self._session.progress) as bar:
            return self._rank_call(rank, deadline, what, get_on).fn()

    def _put(
        self,
        name: str,
        t: torch.Tensor,
        segment: shm.Segment | None,
        bar: Progress,
        hand_over: bool = False,
    ) -> Callable[[WorkerEndpoint, float], None]:
        nbytes = t.numel() * t.element_size()

        def put_on(endpoint: WorkerEndpoint, remaining: float) -> None:
            shared = segment is not None and self._shm_ok(endpoint.address)
            route = choose_path(endpoint, remaining, nbytes=nbytes, shared_memory=shared)
            if route.path is DataPath.SHM:
                assert segment is not None
                try:
                    put_tensor_shm(
                        endpoint, name, t, segment, remaining, self._session.shm_pool, hand_over
                    )
                    bar.advance(nbytes)
                    return
                except CollectiveError as err:
                    if not self._shm_refused_by(endpoint.address, err):
                        raise
                route = choose_path(endpoint, remaining, nbytes=nbytes)  # refused: not shm
            put_tensor(endpoint, name, t, remaining, route=route, progress=bar)

        return put_on

    # --- shared-memory fast path ---------------------------------------------

    def shm_wanted(self, ranks: list[int], deadline: float) -> bool:
        """Whether a put to ``ranks`` should write a shared-memory segment."""
        if not self._session.shared_memory or not shm.available():
            return False
        snapshot = self._session.formed_snapshot(deadline)
        try:
            return any(self._shm_ok(snapshot.address_of(r)) for r in ranks)
        except CollectiveError:
            return False

    def _shm_ok(self, address: str) -> bool:
        """Same host (hostname as the coordinator reports it) and a loopback address."""
        if not self._session.shared_memory or address in self._shm_refused:
            return False
        host = address.rpartition(":")[0].strip("[]")
        if not _is_loopback(host):
            return False
        hostname = _local_hostname()
        return any(
            w.address == address and w.hostname == hostname
            for w in self._session.snapshot().workers
        )

    def _shm_refused_by(self, address: str, err: CollectiveError) -> bool:
        """True (and remembered) when a worker cannot do shared memory: fall back to the stream."""
        if err.code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
            self._shm_refused.add(address)
            return True
        # The worker's segments or quota are full right now: this call streams.
        return err.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    def _rank_call(
        self,
        rank: int,
        deadline: float,
        what: str,
        fn: Callable[[WorkerEndpoint, float], R],
    ) -> Job[R]:
        """A retrying call of ``fn(endpoint_of_rank, remaining_s)``, re-resolving the rank."""

        def attempt(remaining: float) -> R:
            address = self._session.formed_snapshot(time.monotonic() + remaining).address_of(rank)
            return fn(self._session.endpoint(address), remaining)

        def call() -> R:
            try:
                return self._session.retry(
                    f"{what} on rank {rank}", deadline, attempt, is_retryable_read
                )
            except CollectiveError as err:
                raise annotate(err, f"{what} on rank {rank}") from None

        return Job(call)


def _put_stream(
    name: str, t: torch.Tensor, bar: Progress
) -> Callable[[WorkerEndpoint, float], None]:
    def put_on(endpoint: WorkerEndpoint, remaining: float) -> None:
        put_tensor(endpoint, name, t, remaining, progress=bar)

    return put_on


def _local_hostname() -> str:
    """This host's name, compared with the hostname each worker registered with."""
    return socket.gethostname()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _copied_out(name: str, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``t`` (a get through shared memory) copied into the caller's ``out``."""
    nbytes = t.numel() * t.element_size()
    codec.check_out(out, codec.CheckedHeader(name, t.dtype, tuple(t.shape), nbytes))
    return out.copy_(t)
