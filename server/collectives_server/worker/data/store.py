"""The worker's named tensor store.

Tensors live on the worker's device between calls and survive generation
changes. Stored tensors are never mutated in place: every write (put, or a
collective's commit) swaps in a new tensor object, so a reader streaming a
tensor out, or a collective working on a snapshot, never sees a half-written
value, and a failed collective leaves the old value untouched.

**Commit fences.** A collective's result is committed on every rank a moment
apart, and the leader answers the client as soon as *it* has committed. A
rank therefore fences the name its result goes to before its last exchange
with the other ranks (which the leader cannot complete before every rank has
entered it) and lifts the fence after committing or giving up; a read
(:meth:`TensorStore.get`, :meth:`TensorStore.infos`) of a fenced name waits for
that. So a client that reads any rank right after the leader answered sees the
result, never the value before it, without a cluster-wide barrier per op. A
put or a delete of a fenced name waits the same way, so it lands after the
commit instead of under it (a put issued once the leader answered would
otherwise be overwritten by a follower's commit still on its way).
:meth:`TensorStore.peek` is the executor's own unfenced look-up.

**A handoff.** While a drain hands a rank over, both ends' stores are closed to
clients. The drained worker's refuses at once (the rank is no longer there: the
SDK sends the call to the successor). The successor's holds a call until the
copy is installed, so the call runs then instead of being refused and sent again;
a call held past :data:`HANDOFF_HOLD_S`, or beyond :data:`MAX_HELD_CALLS` held at
once (each holds a server thread), is refused as on the drained worker, and so is
every held call when the handoff is called off (the rank stays where it was: a put
let through then would land on a worker that does not hold the rank).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from collectives.errors import (
    FailedPrecondition,
    NotFound,
    Reason,
    ResourceExhausted,
    Unavailable,
)
from collectives.wire.names import ARCHIVE_PREFIX, UPLOAD_PREFIX

__all__ = [
    "Fence",
    "result_of",
    "Reservation",
    "StoredInfo",
    "TensorStore",
    "WriteWatch",
    "UPLOAD_PREFIX",
    "UPLOAD_IDLE_S",
    "quota_message",
    "upload_prefix",
]

# Publish and replicated-put uploads (``__publish/<id>/<key>``) wait on the leader
# for their op, which removes them; those of a client that died before calling it
# are dropped once no put under their id came for UPLOAD_IDLE_S.
UPLOAD_IDLE_S = 300.0
# A successor's store holds a client's call this long at most for the handoff to end
# (then refuses it, and the SDK retries), and this many calls at once.
HANDOFF_HOLD_S = 2.0
MAX_HELD_CALLS = 8


class WriteWatch:
    """The names a running op reads or writes (:meth:`TensorStore.watch_name`), and those a
    client's put or delete wrote since the op began watching them: such a write is
    later in the order than the op, so the op's result must not be stored over it
    (:meth:`TensorStore.replace`)."""

    __slots__ = ("names", "written")

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.written: set[str] = set()


@dataclass(frozen=True)
class StoredInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    device: str


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quota_message(name: str, incoming: int, after: int, limit: int) -> str:
    """The words of a quota refusal (a put's, or a collective's on any rank)."""
    return (
        f"storing {name!r} ({incoming} bytes) would put {after} bytes in this worker's "
        f"store; its limit is {limit}. Delete tensors or raise the limit."
    )


class Fence:
    """A pending write to one name (see the module docstring); lift it with :meth:`release`."""

    __slots__ = ("_released", "_store", "deadline", "name")

    def __init__(self, store: TensorStore, name: str, deadline: float) -> None:
        self._store = store
        self.name = name
        self.deadline = deadline
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store._lift(self)

    def __enter__(self) -> Fence:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Reservation:
    """Bytes counted against a store's quota while a transfer is received."""

    def __init__(self, store: TensorStore, nbytes: int, what: str) -> None:
        self._store, self.nbytes, self.what = store, nbytes, what
        self._held = True

    def release(self) -> None:
        """Gives the bytes back; idempotent."""
        if self._held:
            self._held = False
            self._store._unreserve(self.nbytes)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class TensorStore:
    def __init__(self, device: torch.device, limit_bytes: int | None = None) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self._tensors: dict[str, torch.Tensor] = {}
        # Which op committed each name's value (generation, op id), and that value (weakly):
        # a read-back of the op's result checks it is still the one (get's result_of).
        self._committed: dict[str, tuple[tuple[int, int], weakref.ref[torch.Tensor]]] = {}
        self._bytes = 0
        # Bytes of transfers being received (puts in progress): counted against
        # the quota from their header on, so concurrent puts cannot overshoot it.
        self._reserved = 0
        self._lock = threading.Lock()
        self._fenced = threading.Condition(self._lock)
        self._fences: dict[str, list[Fence]] = {}
        self._waiting = 0
        self._uploads: dict[str, float] = {}  # upload prefix -> time of its latest put
        self._watches: list[WriteWatch] = []  # the running ops' (one per generation's executor)
        # Why clients are refused (a drain's handoff in progress); None: open.
        self._closed_why: str | None = None
        # Whether calls wait for the store to open (a successor's) rather than being
        # refused at once, how many wait now, and whether the copy they wait for is
        # installed (then they run; a store opened without it refuses them).
        self._holds = False
        self._held = 0
        self._installed = False
        self._opened = threading.Condition(self._lock)

    # ---- a drain's handoff (collectives_server.worker.transport.handoff) -------------------

    def close_for_handoff(self, why: str, *, hold: bool = False) -> None:
        """From now on what is stored cannot change: every read and write answers
        UNAVAILABLE saying ``why`` (the SDK retries it on whoever holds the rank next),
        or, with ``hold`` (the successor), first waits for the copy's :meth:`install`,
        then runs (see the module's notes)."""
        with self._lock:
            self._closed_why = why
            self._holds = hold
            self._installed = False

    def reopen(self) -> None:
        """Serves clients again (a handoff that ended or was called off; calls still
        held then without an :meth:`install` are refused)."""
        with self._lock:
            self._closed_why = None
            self._holds = False
            self._opened.notify_all()

    @property
    def closed_for_handoff(self) -> bool:
        return self._closed_why is not None

    @property
    def held_calls(self) -> int:
        """Calls waiting now for a successor's store to open (for status and tests)."""
        with self._lock:
            return self._held

    def check_open(self) -> None:
        """Raises UNAVAILABLE (saying why) while a handoff has closed this store: also
        what must not change the rank's models (their gradients move with it)."""
        with self._lock:
            self._check_open()

    def contents(self) -> dict[str, torch.Tensor]:
        """Every stored tensor by name (a handoff's source; also while closed)."""
        with self._lock:
            return dict(self._tensors)

    def install(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replaces everything stored by ``tensors`` at once (a handoff's successor: the
        rank's state is the drained worker's), within the quota or not at all.

        Raises:
            ResourceExhausted: they do not fit in the quota (nothing changed).
        """
        with self._lock:
            self._check_fits(tensors)
            for watch in self._watches:  # every name may have changed
                watch.written |= watch.names
            self._tensors = dict(tensors)
            self._bytes = sum(_nbytes(t) for t in tensors.values())
            self._uploads.clear()
            self._installed = True  # the calls held for it run now
            self._opened.notify_all()

    def check_fits(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raises ResourceExhausted unless ``tensors`` would fit in place of everything
        stored (what :meth:`install` checks)."""
        with self._lock:
            self._check_fits(tensors)

    def _check_fits(self, tensors: dict[str, torch.Tensor]) -> None:
        total = sum(_nbytes(t) for t in tensors.values())
        if self.limit_bytes is not None and total + self._reserved > self.limit_bytes:
            raise ResourceExhausted(
                f"the handoff's {len(tensors)} tensors ({total} bytes) do not fit in this "
                f"worker's --max-tensor-bytes ({self.limit_bytes})"
            )

    def _check_open(self) -> None:
        """With the lock held: refuses a client's call while a handoff runs, once a
        successor's store has held it as long as it may."""
        if self._closed_why is None or (self._holds and self._installed):
            return
        if self._holds and self._held < MAX_HELD_CALLS:
            self._held += 1
            try:
                self._opened.wait_for(
                    lambda: self._installed or self._closed_why is None, HANDOFF_HOLD_S
                )
            finally:
                self._held -= 1
            if self._installed:
                return  # the rank's state is here now
            if self._closed_why is None:
                raise Unavailable(
                    "the handoff this worker was receiving was called off: the rank stays "
                    "where it was; retry",
                    executed=False,
                )
        raise Unavailable(self._closed_why, executed=False)  # refused before it ran

    def check_quota(self, name: str, incoming: int) -> None:
        """Raises ResourceExhausted if ``incoming`` bytes under ``name`` would exceed the limit
        (stored bytes plus those reserved by transfers in progress)."""
        if self.limit_bytes is None:
            return
        current = self._tensors.get(name)
        held = self._bytes + self._reserved
        after = held - (_nbytes(current) if current is not None else 0) + incoming
        if after > self.limit_bytes:
            raise ResourceExhausted(quota_message(name, incoming, after, self.limit_bytes))

    def reserve(self, name: str, nbytes: int, what: str = "put") -> Reservation:
        """Counts ``nbytes`` against the quota until released: call before receiving.

        Raises:
            ResourceExhausted: they do not fit beside what is stored and reserved.
        """
        with self._lock:
            self._check_open()
            self.check_quota(name, nbytes)
            self._reserved += nbytes
        return Reservation(self, nbytes, what)

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def quota_state(self, name: str) -> tuple[int, int]:
        """(bytes held apart from ``name``'s current value, the limit; -1: none): what
        another rank needs to judge whether a result stored under ``name`` here fits."""
        with self._lock:
            current = self._tensors.get(name)
            others = self._bytes - (_nbytes(current) if current is not None else 0)
        return others, -1 if self.limit_bytes is None else self.limit_bytes

    # ------------------------------------------------------------- fences
    def fence(self, name: str, timeout_s: float) -> Fence:
        """Makes reads of ``name`` wait until the returned fence is released (at most
        ``timeout_s``: a fence outliving it is a stuck op, whose commit never comes)."""
        f = Fence(self, name, time.monotonic() + timeout_s)
        with self._lock:
            self._fences.setdefault(name, []).append(f)
        return f

    def _lift(self, f: Fence) -> None:
        with self._lock:
            held = self._fences.get(f.name)
            if held is not None:
                held.remove(f)
                if not held:
                    del self._fences[f.name]
            self._fenced.notify_all()

    def _wait_unfenced(self, name: str | None) -> None:
        """With the lock held: waits while ``name`` (None: any name) is fenced."""
        while True:
            if name is None:
                pending = [f for held in self._fences.values() for f in held]
            else:
                pending = self._fences.get(name, ())
            if not pending:
                return
            remaining = max(f.deadline for f in pending) - time.monotonic()
            if remaining <= 0:
                return
            self._waiting += 1
            try:
                self._fenced.wait(remaining)
            finally:
                self._waiting -= 1

    def fenced(self) -> list[str]:
        """Names with a pending write (for status and tests)."""
        with self._lock:
            return sorted(self._fences)

    def readers_waiting(self) -> int:
        """Calls (reads, puts, deletes) waiting for a fence right now (for status and tests)."""
        with self._lock:
            return self._waiting

    def put(self, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """Stores ``t`` (moved to the store's device) under ``name``; returns the value
        it replaced, if any."""
        if t.device != self.device:
            t = t.to(self.device)
        with self._lock:
            self._check_open()
            if self._fences:
                self._wait_unfenced(name)  # after a pending commit, not under it
            self.check_quota(name, _nbytes(t))
            self._note_write(name)
            return self._set(name, t)

    def put_many(self, tensors: dict[str, torch.Tensor], enforce_quota: bool = True) -> None:
        with self._lock:
            self._check_open()
            if self._fences:
                for name in tensors:
                    self._wait_unfenced(name)  # after pending commits, not under them
            for name, t in tensors.items():
                if enforce_quota:
                    self.check_quota(name, _nbytes(t))
            for name, t in tensors.items():
                self._note_write(name)
                self._set(name, t)

    def _set(self, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """With the lock held: stores ``t`` under ``name``; returns the value it replaced."""
        old = self._tensors.get(name)
        if old is not None:
            self._bytes -= _nbytes(old)
        self._tensors[name] = t
        self._bytes += _nbytes(t)
        self._touch_staged(name)
        return old

    def replace(
        self,
        name: str,
        t: torch.Tensor,
        watch: WriteWatch | None = None,
        op: tuple[int, int] | None = None,
    ) -> torch.Tensor | None:
        """Commits ``t`` under ``name`` without a quota check (a collective's commit: its
        quota was judged on every rank before the op); returns the value replaced.

        ``watch``: the op's; the commit is skipped if a put or delete of ``name`` came
        since the op began watching it (even a delete of a name that was absent):
        that write is later in the order than the op, and its result must not be
        stored over it. ``op``: the op committing it (generation, op id), for
        :meth:`get`'s ``result_of``."""
        with self._lock:
            if watch is not None and name in watch.written:
                return None
            old = self._set(name, t)
            if op is not None:
                self._committed[name] = (op, weakref.ref(t))
        return old

    def watch(self) -> WriteWatch:
        """A new watch of client writes, for an op about to run (see :class:`WriteWatch`)."""
        watch = WriteWatch()
        with self._lock:
            self._watches.append(watch)
        return watch

    def unwatch(self, watch: WriteWatch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    def watch_name(self, watch: WriteWatch, name: str) -> None:
        """From now on a put or delete of ``name`` is noted in ``watch``."""
        with self._lock:
            watch.names.add(name)

    def _note_write(self, name: str) -> None:
        """Under the lock: a client wrote or deleted ``name`` (the watches note it)."""
        for watch in self._watches:
            if name in watch.names:
                watch.written.add(name)

    def _touch_staged(self, name: str) -> None:
        """Under the lock: a publish upload or a staged model archive expires once
        idle for ``UPLOAD_IDLE_S`` (its client may have died before using it)."""
        if name.startswith(UPLOAD_PREFIX):
            self._uploads[upload_prefix(name)] = time.monotonic()
        elif name.startswith(ARCHIVE_PREFIX):
            self._uploads[name] = time.monotonic()

    def adopt(self, name: str, t: torch.Tensor, upload: str) -> torch.Tensor | None:
        """Commits ``t`` under ``name`` as :meth:`replace` does and, in the same step,
        drops ``upload`` if it still holds ``t``: a replicated put's commit on the
        leader keeps the uploaded tensor itself (no copy, never counted twice).
        Returns the value replaced under ``name``."""
        with self._lock:
            if self._tensors.get(upload) is t:
                del self._tensors[upload]
                self._bytes -= _nbytes(t)
            old = self._set(name, t)
        return old

    def get(self, name: str, result_of: tuple[int, int] | None = None) -> torch.Tensor:
        """The committed value of ``name``; waits for a pending write to it (a fence).

        ``result_of``: the op (generation, op id) whose result the caller reads back;
        FAILED_PRECONDITION (``RESULT_REPLACED``) when ``name`` holds anything else."""
        with self._lock:
            self._check_open()
            if self._fences:
                self._wait_unfenced(name)
            t = self._tensors.get(name)
            committed = self._committed.get(name)
        if result_of is not None and (
            committed is None or committed[0] != result_of or committed[1]() is not t
        ):
            generation, op_id = result_of
            raise FailedPrecondition(
                f"the result of op {op_id} (generation {generation}) under {name!r} on this "
                "worker was written over (or deleted) before it was read back: names are "
                "shared, another client wrote it in between; give the result a name of "
                "your own (out=...)",
                tensor=name,
                reason=Reason.RESULT_REPLACED,
            )
        if t is None:
            raise NotFound(f"tensor {name!r} is not stored on this worker")
        return t

    def peek(self, name: str, watch: WriteWatch | None = None) -> torch.Tensor | None:
        """The value of ``name`` or None, without waiting for fences (the executor's
        look-up); with ``watch``, ``name`` is watched from this read on, in one step."""
        with self._lock:
            if watch is not None:
                watch.names.add(name)
            return self._tensors.get(name)

    def delete(self, name: str) -> bool:
        """Deletes ``name``; waits for a pending write to it (a fence) first."""
        with self._lock:
            self._check_open()
            if self._fences:
                self._wait_unfenced(name)
            self._note_write(name)  # absent or not: a running op's result stays out
            if name.startswith(ARCHIVE_PREFIX):
                self._uploads.pop(name, None)
            t = self._tensors.pop(name, None)
            self._committed.pop(name, None)
            if t is None:
                return False
            self._bytes -= _nbytes(t)
            return True

    def delete_if_same(self, name: str, t: torch.Tensor) -> bool:
        """Deletes ``name`` only if it still holds ``t`` (not a newer value)."""
        with self._lock:
            if self._tensors.get(name) is not t:
                return False
            self._note_write(name)
            if name.startswith(ARCHIVE_PREFIX):
                self._uploads.pop(name, None)
            del self._tensors[name]
            self._committed.pop(name, None)
            self._bytes -= _nbytes(t)
            return True

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every tensor whose name starts with ``prefix``; returns how many."""
        with self._lock:
            self._uploads.pop(prefix, None)
            doomed = [n for n in self._tensors if n.startswith(prefix)]
            for n in doomed:
                self._note_write(n)
                self._bytes -= _nbytes(self._tensors.pop(n))
                self._committed.pop(n, None)
            return len(doomed)

    def under(self, prefix: str) -> list[tuple[str, torch.Tensor]]:
        """Every (name, tensor) whose name starts with ``prefix``, by name."""
        with self._lock:
            return sorted((n, t) for n, t in self._tensors.items() if n.startswith(prefix))

    def expire_uploads(self, idle_s: float = UPLOAD_IDLE_S, now: float | None = None) -> int:
        """Drops publish uploads and staged archives idle for ``idle_s``; how many tensors."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [p for p, at in self._uploads.items() if now - at >= idle_s]
        return sum(self.delete_prefix(p) for p in stale)

    def infos(self) -> list[StoredInfo]:
        with self._lock:
            self._check_open()
            if self._fences:
                self._wait_unfenced(None)
            items = list(self._tensors.items())
        return [
            StoredInfo(n, t.dtype, tuple(t.shape), _nbytes(t), str(t.device))
            for n, t in sorted(items)
        ]

    def stats(self) -> tuple[int, int]:
        """(tensors held, bytes held)."""
        with self._lock:
            return len(self._tensors), self._bytes


def upload_prefix(name: str) -> str:
    """``__publish/<id>/<key>`` -> ``__publish/<id>/``."""
    head, _, rest = name[len(UPLOAD_PREFIX) :].partition("/")
    return f"{UPLOAD_PREFIX}{head}/" if rest else name


def result_of(request: Any) -> tuple[int, int] | None:
    """A get request's ``result_of`` (the op whose result it reads back), if it names one."""
    if not request.HasField("result_of"):
        return None
    return (request.result_of.generation, request.result_of.op_id)
