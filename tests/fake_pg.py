"""An in-memory world of N ranks whose process groups act like gloo's, for running the
worker's op handlers on N threads (one per rank) without a network (torchft's
FakeProcessGroupWrapper idea). Only the ``ProcessGroup`` subset the worker calls exists.

As with gloo, a call enqueues the op and returns a :class:`FakeWork`: ops are matched
across ranks by each rank's call sequence number (a rank may issue a broadcast, issue the
next collective, then wait on both); the last rank to issue an op fills every rank's
outputs (reductions fold in rank order: deterministic); errors surface at ``wait()``, bad
arguments at the call. Every wait has a deadline. :meth:`FakeWorld.fail_next` and
:meth:`FakeWorld.kill` inject failures; ``world.calls[rank][method]`` counts calls.
Point to point (``send``/``recv``) is matched apart from the collectives' sequence,
by (src, dst, tag) in posting order, and checks the sizes agree, as gloo does.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["FakeProcessGroup", "FakeWork", "FakeWorld", "run_ranks"]

_FOLD: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "SUM": torch.add,
    "AVG": torch.add,
    "PRODUCT": torch.mul,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}
_BITWISE = ("BAND", "BOR", "BXOR")


def _copy(exc: BaseException) -> BaseException:
    """A fresh instance: a shared error is raised on several ranks' threads at once."""
    return type(exc)(*exc.args)


def _dims(t: torch.Tensor) -> str:
    return f"({', '.join(map(str, t.shape))})"


def _invalid(method: str, msg: str) -> RuntimeError:
    return RuntimeError(f"ProcessGroupGloo::{method}: {msg}")


@dataclass
class _Slot:
    """One collective: the matching calls of every rank at one sequence number."""

    seq: int
    signature: tuple[Any, ...] | None = None
    args: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)  # a rank's own error
    peer_error: BaseException | None = None  # what every other rank raises
    done: bool = False  # outputs filled or failed: no rank waits any longer
    expired: str = ""  # why a rank stopped waiting for the missing ones


class FakeWork:
    """What a fake collective returns: ``wait()`` blocks until every rank issued it."""

    def __init__(self, world: FakeWorld, rank: int, slot: _Slot, method: str) -> None:
        self._world, self._rank, self._slot, self._method = world, rank, slot, method
        self._issued = time.monotonic()

    def _error(self) -> BaseException | None:
        slot = self._slot
        return slot.errors.get(self._rank, slot.peer_error)

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """True once this rank's outputs are filled; raises the op's error, or a
        RuntimeError when the deadline (the world's ``timeout_s``) passes first."""
        deadline = self._issued + self._world.timeout_s
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if timeout is not None:
            deadline = min(deadline, time.monotonic() + timeout)
        slot, cond = self._slot, self._world._cond
        with cond:
            while not slot.done and self._error() is None:
                left = deadline - time.monotonic()
                if left <= 0:  # later arrivals fail too; the waiting ranks time out
                    missing = sorted(set(range(self._world.size)) - set(slot.args))
                    why = (
                        f"rank {self._rank}: {self._method} #{slot.seq} timed out after"
                        f" {time.monotonic() - self._issued:.1f}s waiting for rank(s) {missing}"
                    )
                    slot.expired = slot.expired or why
                    slot.errors[self._rank] = RuntimeError(f"[fake gloo] {why}")
                    break
                cond.wait(left)
            own, peer = slot.errors.get(self._rank), slot.peer_error
        if own is not None:
            raise own
        if peer is not None:
            raise _copy(peer)
        return True

    def is_completed(self) -> bool:
        with self._world._cond:
            return self._slot.done or self._error() is not None


class FakeWorld:
    """N ranks sharing in-memory collectives; ``world.pg(rank)`` is used by rank's thread."""

    def __init__(self, size: int, timeout_s: float = 10.0) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self.calls: list[Counter[str]] = [Counter() for _ in range(size)]
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._fail_next: dict[int, BaseException] = {}
        self._dead: set[int] = set()
        # (src, dst, tag) -> posted and not yet matched {"send": [...], "recv": [...]}
        self._mailboxes: dict[tuple[int, int, int], dict[str, list[_Post]]] = {}
        self._cut: dict[tuple[int, int, int], BaseException] = {}  # pairs a failure cut
        self._pgs = [FakeProcessGroup(self, rank) for rank in range(size)]

    def pg(self, rank: int) -> FakeProcessGroup:
        return self._pgs[rank]

    def fail_next(self, rank: int, exc: BaseException) -> None:
        """``rank``'s next collective raises ``exc`` at wait; its peers get a RuntimeError."""
        with self._cond:
            self._fail_next[rank] = exc

    def kill(self, rank: int) -> None:
        """``rank`` dies: every op not yet complete, and every later op on every rank,
        raises RuntimeError (as gloo does once a peer's connections close)."""
        with self._cond:
            self._dead.add(rank)
            posted = [p.slot for box in self._mailboxes.values() for q in box.values() for p in q]
            for slot in [*self._slots.values(), *posted]:
                if not slot.done:
                    slot.peer_error = self._dead_error(rank)
                    slot.done = True
            self._mailboxes.clear()
            self._cond.notify_all()

    def _dead_error(self, rank: int) -> RuntimeError:
        return RuntimeError(f"[fake gloo] Connection closed by peer [rank {rank} died]")

    # ------------------------------------------------------------ matching
    def _issue(
        self,
        rank: int,
        seq: int,
        method: str,
        signature: tuple[Any, ...],
        args: tuple[Any, ...],
        local_error: BaseException | None = None,
    ) -> FakeWork:
        with self._cond:
            slot = self._slots.setdefault(seq, _Slot(seq))
            work = FakeWork(self, rank, slot, method)
            injected = self._fail_next.pop(rank, None)
            if slot.expired:  # a peer gave up on this op before this rank issued it
                slot.peer_error = slot.peer_error or RuntimeError(f"[fake gloo] {slot.expired}")
                local_error = RuntimeError(
                    f"[fake gloo] Connection closed by peer [{slot.expired}]"
                )
            if self._dead:
                slot.errors[rank] = slot.peer_error = self._dead_error(min(self._dead))
            elif injected is not None or local_error is not None:
                slot.errors[rank] = own = injected if injected is not None else local_error
                slot.peer_error = slot.peer_error or RuntimeError(
                    f"[fake gloo] Connection closed by peer [rank {rank}: {own!r}]"
                )
            elif slot.signature is not None and slot.signature != signature:
                slot.peer_error = RuntimeError(
                    f"[fake gloo] collective mismatch at #{seq}: rank {rank} issued"
                    f" {signature}, an earlier rank issued {slot.signature}"
                )
            slot.signature = slot.signature or signature
            slot.args[rank] = args
            if slot.peer_error is not None:
                slot.done = True
            elif len(slot.args) == self.size:
                try:
                    _COMPUTE[method](slot, self.size)
                except Exception as exc:  # e.g. AVG of integers: every rank raises it
                    slot.peer_error = exc
                slot.done = True
            if slot.done:
                for r in slot.args:
                    slot.args[r] = ()  # drop the tensor references
                self._cond.notify_all()
            if len(slot.args) == self.size:
                del self._slots[seq]
            return work

    # ------------------------------------------------------- point to point
    def _post(self, rank: int, peer: int, tag: int, method: str, t: torch.Tensor) -> FakeWork:
        """A send (rank -> peer) or recv (peer -> rank), matched with its counterpart."""
        key = (rank, peer, tag) if method == "send" else (peer, rank, tag)
        with self._cond:
            post = _Post(_Slot(-1, args={rank: ()}), t)
            work = FakeWork(self, rank, post.slot, method)
            injected = self._fail_next.pop(rank, None)
            if self._dead:
                post.fail(self._dead_error(min(self._dead)))
            elif injected is not None:
                post.fail(injected)
                cut = RuntimeError(
                    f"[fake gloo] Connection closed by peer [rank {rank}: {injected!r}]"
                )
                self._cut[key] = cut
                for waiting in self._mailboxes.pop(key, {}).get(_OTHER[method], []):
                    waiting.fail(cut)
            elif key in self._cut:
                post.fail(self._cut[key])
            else:
                box = self._mailboxes.setdefault(key, {"send": [], "recv": []})
                box[method].append(post)
                while box["send"] and box["recv"]:
                    _deliver(box["send"].pop(0), box["recv"].pop(0))
                if not box["send"] and not box["recv"]:
                    del self._mailboxes[key]
            self._cond.notify_all()
            return work


@dataclass
class _Post:
    slot: _Slot
    tensor: torch.Tensor

    def fail(self, exc: BaseException) -> None:
        self.slot.errors[next(iter(self.slot.args))] = exc
        self.slot.done = True


_OTHER = {"send": "recv", "recv": "send"}


def _deliver(send: _Post, recv: _Post) -> None:
    """Copies the send's bytes into the recv's buffer; gloo fails both on a size mismatch."""
    sent, into = send.tensor, recv.tensor
    n, m = sent.numel() * sent.element_size(), into.numel() * into.element_size()
    if n != m:
        error = RuntimeError(f"[fake gloo] message size mismatch: sent {n} bytes, expected {m}")
        send.fail(error)
        recv.fail(_copy(error))
        return
    into.reshape(-1).view(torch.uint8).copy_(sent.reshape(-1).view(torch.uint8))
    send.slot.done = recv.slot.done = True


class FakeProcessGroup:
    """One rank's view of a :class:`FakeWorld` (the gloo-like subset the worker uses)."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self._world, self._rank, self._seq = world, rank, 0

    def size(self) -> int:
        return self._world.size

    def rank(self) -> int:
        return self._rank

    def _issue(
        self,
        method: str,
        signature: tuple[Any, ...],
        args: tuple[Any, ...],
        local_error: BaseException | None = None,
    ) -> FakeWork:
        seq, self._seq = self._seq, self._seq + 1
        return self._world._issue(self._rank, seq, method, (method, *signature), args, local_error)

    def _begin(self, method: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        with self._world._cond:
            self._world.calls[self._rank][method] += 1
        if len(tensors) != 1:
            raise _invalid(method, "requires a single-element tensor list")
        return tensors[0]

    def _root(self, method: str, root: int) -> int:
        if not 0 <= root < self.size():
            raise _invalid(method, f"invalid root rank: {root}")
        return root

    def _outputs(
        self, method: str, outputs: Sequence[Sequence[torch.Tensor]], t: torch.Tensor
    ) -> list[torch.Tensor]:
        if len(outputs) != 1:
            raise _invalid(method, "requires a single-element output list")
        outs, n, bad = list(outputs[0]), self.size(), ""
        if len(outs) != n:
            bad = f"invalid output tensor list at index 0 (expected length {n}, got {len(outs)})"
        for i, o in enumerate(outs):
            if not bad and o.dtype != t.dtype:
                bad = f"invalid tensor type at index {i} (expected {t.dtype}, got {o.dtype})"
            if not bad and o.shape != t.shape:
                bad = f"invalid tensor size at index {i} (expected {_dims(t)}, got {_dims(o)})"
        if bad:
            raise _invalid(method, bad)
        return outs

    def allreduce(
        self, tensors: Sequence[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> FakeWork:
        t = self._begin("allreduce", tensors)
        op = (opts or dist.AllreduceOptions()).reduceOp.op.name
        local = None
        if op in _BITWISE and (t.is_floating_point() or t.is_complex()):
            local = RuntimeError(f"Cannot use ReduceOp.{op} with non-integral dtype")
        return self._issue("allreduce", (t.dtype, t.numel(), op), (t, op), local)

    def allgather(
        self,
        output_tensors: Sequence[Sequence[torch.Tensor]],
        input_tensors: Sequence[torch.Tensor],
    ) -> FakeWork:
        t = self._begin("allgather", input_tensors)
        outs = self._outputs("allgather", output_tensors, t)
        return self._issue("allgather", (t.dtype, t.numel()), (t, outs))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor) -> FakeWork:
        t = self._begin("_allgather_base", [input])
        outs = self._outputs("allgather", [list(output.chunk(self.size()))], t)  # as gloo does
        return self._issue("_allgather_base", (t.dtype, t.numel()), (t, outs))

    def broadcast(
        self, tensors: Sequence[torch.Tensor], opts: dist.BroadcastOptions | None = None
    ) -> FakeWork:
        t = self._begin("broadcast", tensors)
        root = self._root("broadcast", (opts or dist.BroadcastOptions()).rootRank)
        return self._issue("broadcast", (t.dtype, t.numel(), root), (t, root))

    def gather(
        self,
        output_tensors: Sequence[Sequence[torch.Tensor]],
        input_tensors: Sequence[torch.Tensor],
        opts: dist.GatherOptions | None = None,
    ) -> FakeWork:
        t = self._begin("gather", input_tensors)
        root = self._root("gather", (opts or dist.GatherOptions()).rootRank)
        if self._rank == root:
            outs = self._outputs("gather", output_tensors, t)
        elif len(output_tensors):
            raise _invalid("gather", "requires empty output on non-root")
        else:
            outs = []
        return self._issue("gather", (t.dtype, t.numel(), root), (t, outs))

    def send(self, tensors: Sequence[torch.Tensor], dstRank: int, tag: int = 0) -> FakeWork:  # noqa: N803
        t = self._begin("send", tensors)
        return self._world._post(self._rank, self._root("send", dstRank), tag, "send", t)

    def recv(self, tensors: Sequence[torch.Tensor], srcRank: int, tag: int = 0) -> FakeWork:  # noqa: N803
        t = self._begin("recv", tensors)
        return self._world._post(self._rank, self._root("recv", srcRank), tag, "recv", t)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: dist.AllToAllOptions | None = None,
    ) -> FakeWork:
        self._begin("alltoall_base", [input])
        if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
            raise _invalid("alltoall_base", "tensors must have the same type and row shape")
        n, splits, local = self.size(), [], None
        for t, given in ((input, input_split_sizes), (output, output_split_sizes)):
            rows = t.shape[0]
            given = list(given) or [rows // n] * n  # rows % n: gloo hangs, this raises at wait
            if len(given) != n or sum(given) != rows or min(given) < 0:
                local = RuntimeError("Split sizes doesn't match total dim 0 size")  # at wait
            splits.append(given)
        signature = (input.dtype, tuple(input.shape[1:]))
        return self._issue("alltoall_base", signature, (input, output, *splits), local)


# ---------------------------------------------------------------- computing
def _allreduce(slot: _Slot, size: int) -> None:
    tensors = [slot.args[r][0] for r in range(size)]
    op = slot.args[0][1]
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = _FOLD[op](acc, t)
    if op == "AVG":
        acc.div_(size)
    for t in tensors:
        t.copy_(acc)


def _allgather(slot: _Slot, size: int) -> None:
    """allgather and gather: rank r's input lands in output r of every rank that gave outputs."""
    rows = [slot.args[r][0].clone() for r in range(size)]
    for r in range(size):
        for out, row in zip(slot.args[r][1], rows, strict=False):
            out.copy_(row)


def _broadcast(slot: _Slot, size: int) -> None:
    root = slot.args[0][1]
    value = slot.args[root][0].clone()
    for r in range(size):
        if r != root:
            slot.args[r][0].copy_(value)


def _alltoall_base(slot: _Slot, size: int) -> None:
    """Chunk j of rank i's input (input_split_sizes[j] rows) lands as chunk i of rank j."""
    sent = [[c.clone() for c in slot.args[i][0].split(slot.args[i][2])] for i in range(size)]
    for j in range(size):
        expected, got = slot.args[j][3], [sent[i][j].shape[0] for i in range(size)]
        if expected != got:
            raise RuntimeError(
                f"[fake gloo] alltoall_base split mismatch: rank {j} expects {expected} rows"
                f" from ranks 0..{size - 1}, which send {got}"
            )
    for j in range(size):
        for i, out in enumerate(slot.args[j][1].split(slot.args[j][3])):
            out.copy_(sent[i][j])


_COMPUTE: dict[str, Callable[[_Slot, int], None]] = {
    "allreduce": _allreduce,
    "allgather": _allgather,
    "_allgather_base": _allgather,
    "broadcast": _broadcast,
    "gather": _allgather,
    "alltoall_base": _alltoall_base,
}


# ---------------------------------------------------------------- running ranks
class _World(Protocol):
    size: int

    def pg(self, rank: int) -> Any: ...


def run_ranks(world: _World, fn: Callable[[int, Any], Any], timeout_s: float = 30.0) -> list[Any]:
    """Runs ``fn(rank, world.pg(rank))`` on one daemon thread per rank; returns each rank's
    return value or raised exception. A thread still running after ``timeout_s`` is an
    AssertionError naming its rank (the thread is left behind, never joined)."""
    results: list[Any] = [None] * world.size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, world.pg(rank))
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world.size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise AssertionError(f"rank(s) {stuck} still running after {timeout_s:g}s")
    return results
