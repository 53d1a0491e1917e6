"""Dynamic batching: concurrent no-grad forwards of one model merged into one forward.

A model loaded with a :class:`~collectives.wire.batching.Batching` policy gets a
:class:`Batcher`. A forward that may be merged (no autograd, the model in eval
mode, positional tensor inputs that share dim 0) joins the queue of its
*company*: the forwards of the same version wanted, with inputs alike past dim 0
(dtype, trailing shape, device). The first of a company leads. It waits until
the company's last merged forward ended (one runs at a time, so the callers
arriving meanwhile queue up for the next), then for company only while that
pays: up to ``max_delay_ms`` for as many rows as were in flight when the last
forward ended (the callers it answered are likely back within a round trip; a
lone caller finds its own row and goes at once). It takes the model's lock at
its version (so one merged forward runs on one version, however publishes
interleave), takes the waiting callers FIFO up to ``max_rows`` rows (always at
least one), and hands leadership on so the next batch gathers while this one
runs. In Triton's words: the queue delay is ``max_delay_ms``, the preferred
batch is every caller in flight. The merged output is split back row for row;
a caller's output equals its own rows through the model.

A caller fails alone: inputs unlike the others' never join their company, and a
merged forward that fails, or whose output cannot be split by rows, runs again
caller by caller, each getting its own result or error.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as torch_pytree

from collectives.errors import DeadlineExceeded
from collectives.wire.batching import Batching

__all__ = ["Batcher", "BatchingStats", "ROW_BUCKETS", "company_of"]

# Upper bounds of the rows-per-forward histogram (``collectives_forward_batch_rows``).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


@dataclass
class BatchingStats:
    """What a model's batcher did since the model was loaded."""

    batches: int = 0  # forwards the batcher ran
    calls: int = 0  # callers those forwards served
    rows: int = 0  # their rows
    largest_rows: int = 0
    # Forwards by rows, per ROW_BUCKETS bound and one beyond the last (not cumulative).
    row_counts: list[int] = field(default_factory=lambda: [0] * (len(ROW_BUCKETS) + 1))

    def count(self, calls: int, rows: int) -> None:
        self.batches += 1
        self.calls += calls
        self.rows += rows
        self.largest_rows = max(self.largest_rows, rows)
        i = next((i for i, bound in enumerate(ROW_BUCKETS) if rows <= bound), len(ROW_BUCKETS))
        self.row_counts[i] += 1

    def copy(self) -> BatchingStats:
        return BatchingStats(
            self.batches, self.calls, self.rows, self.largest_rows, list(self.row_counts)
        )


def company_of(args: Any, kwargs: Any) -> tuple[int, tuple] | None:
    """``(rows, what a company shares)`` of a forward's inputs, or None when they cannot
    be merged (keyword inputs, a non-tensor input, no rows, or inputs disagreeing on
    dim 0)."""
    if kwargs or not isinstance(args, tuple) or not args:
        return None
    rows = -1
    alike = []
    for a in args:
        if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.requires_grad:
            return None
        if rows not in (-1, a.shape[0]):
            return None
        rows = a.shape[0]
        alike.append((a.dtype, tuple(a.shape[1:]), a.device))
    if rows <= 0:
        return None
    return rows, tuple(alike)


@dataclass(eq=False)
class _Caller:
    company: tuple
    args: tuple[torch.Tensor, ...]
    rows: int
    taken: bool = False
    done: bool = False
    output: Any = None
    version: int = 0
    error: BaseException | None = None
    # Set when this caller has something to act on: its result came, it was made
    # its company's leader, or (leading) a caller joined its company.
    wake: threading.Event = field(default_factory=threading.Event)


def _split_rows(output: Any, sizes: Sequence[int]) -> list[Any] | None:
    """Each caller's rows of a merged output, or None if some leaf is not a tensor
    with the merged rows on dim 0."""
    leaves, spec = torch_pytree.tree_flatten(output)
    total = sum(sizes)
    if not leaves:
        return None
    parts = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != total:
            return None
        parts.append(leaf.split(list(sizes)))
    return [torch_pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(len(sizes))]


class Batcher:
    """One model's dynamic batcher (see the module).

    Each caller sleeps on its own event and is woken only when it has something
    to act on (its result, the lead, company joining its gathering), never by
    another company's or another caller's business: with many concurrent
    callers a shared condition woke every one of them at each step.
    """

    def __init__(self, policy: Batching) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._queue: list[_Caller] = []
        self._leading: dict[tuple, _Caller] = {}  # company -> the caller leading it
        # Companies with a merged forward running: the next waits for it to end.
        self._running: set[tuple] = set()
        # Each company's rows in flight when its last forward ended: the rows it had
        # just answered (callers likely back within a round trip) and those waiting.
        self._active_rows: dict[tuple, int] = {}
        self._stats = BatchingStats()

    def stats(self) -> BatchingStats:
        with self._lock:
            return self._stats.copy()

    def run(
        self,
        args: tuple[torch.Tensor, ...],
        company: tuple,
        rows: int,
        hold: Callable[[], contextlib.AbstractContextManager[tuple[int, Any]]],
        call: Callable[[Any, tuple], Any],
        deadline: float,
    ) -> tuple[Any, int]:
        """This caller's output of ``call`` and the version it ran at, merged with its
        company's (``company`` also names the version wanted). ``hold`` holds the model
        at that version (its lock) and yields the version and the module to run;
        ``call(module, inputs)`` runs it on positional inputs, raising a domain error
        for bad inputs.

        Raises:
            DeadlineExceeded: no forward took this caller before ``deadline``.
            whatever ``hold`` or ``call`` raise for this caller.
        """
        me = _Caller(company, args, rows)
        with self._lock:
            self._queue.append(me)
            leader = self._leading.get(company)
            if leader is None:
                self._leading[company] = me
            else:
                leader.wake.set()  # it may be gathering: one caller more
        while True:
            with self._lock:
                leads = self._leading.get(company) is me
                me.wake.clear()
            if leads:
                try:
                    self._lead(me, hold, call, deadline)
                finally:
                    self._hand_on(me)
            elif not me.done:
                # Taken by a leader: wait for its result; else wait to lead.
                left = deadline - time.monotonic()
                # Once taken, the result comes whatever the deadline: keep waiting.
                if not me.wake.wait(min(max(left, 0.05), 1.0)):
                    with self._lock:
                        if time.monotonic() >= deadline and not me.taken and not me.done:
                            self._queue.remove(me)
                            if self._leading.get(company) is me:
                                self._hand_on_locked(me)
                            raise DeadlineExceeded(
                                "the forward waited for its batch past its deadline"
                            )
            if me.done:
                break
        if me.error is not None:
            raise me.error
        return me.output, me.version

    def _hand_on(self, leader: _Caller) -> None:
        with self._lock:
            self._hand_on_locked(leader)

    def _hand_on_locked(self, leader: _Caller) -> None:
        """``leader`` leads its company no more: the oldest caller of the company still
        waiting to be taken leads next (the caller holds ``_lock``)."""
        if self._leading.get(leader.company) is not leader:
            return
        del self._leading[leader.company]
        for c in self._queue:
            if c.company == leader.company and not c.taken:
                self._leading[c.company] = c
                c.wake.set()
                return

    def _gathered_rows(self, company: tuple) -> int:
        return sum(c.rows for c in self._queue if c.company == company)

    def _lead(
        self,
        me: _Caller,
        hold: Callable[[], contextlib.AbstractContextManager[tuple[int, Any]]],
        call: Callable[[Any, tuple], Any],
        deadline: float,
    ) -> None:
        company = me.company
        # The model is free for this company once its last merged forward ended: the
        # callers arriving meanwhile queue up and run together.
        self._wait_until(me, deadline, lambda: company not in self._running)
        # Then company is waited for only while it pays: the callers the last forward
        # answered are likely back within a round trip, so up to ``max_delay_ms`` for
        # the rows in flight when it ended; a lone caller, or a company that ran
        # nothing lately, goes at once.
        with self._lock:
            target = min(self.policy.max_rows, self._active_rows.get(company, 0))
        until = min(time.monotonic() + self.policy.max_delay_ms / 1000.0, deadline)
        self._wait_until(me, until, lambda: self._gathered_rows(company) >= target)
        batch: list[_Caller] = []
        try:
            with hold() as (version, module):
                with self._lock:
                    batch = self._take(company)
                    self._running.add(company)
                    self._hand_on_locked(me)  # the next batch gathers while this one runs
                try:
                    outputs, runs = self._forward(batch, lambda inputs: call(module, inputs))
                finally:
                    self._ended(company, sum(c.rows for c in batch))
        except BaseException as exc:
            # The model could not be held at the version wanted (or the forward broke
            # in a way not of one caller's making): this leader fails, and the
            # callers of its batch, if it took one, with it.
            with self._lock:
                if me in self._queue:
                    self._queue.remove(me)
                    me.taken = True
                for c in [me, *batch]:
                    if not c.done:
                        c.error, c.done = exc, True
                        c.wake.set()
            if isinstance(exc, Exception):
                return
            raise
        with self._lock:
            for calls, rows in runs:
                self._stats.count(calls, rows)
            for c, (output, error) in zip(batch, outputs, strict=True):
                c.output, c.error, c.version, c.done = output, error, version, True
                c.wake.set()

    def _wait_until(self, me: _Caller, until: float, ready: Callable[[], bool]) -> None:
        """Waits, woken by company joining or a forward ending, until ``ready()`` (read
        under the lock) or ``until`` (on ``time.monotonic()``)."""
        while True:
            with self._lock:
                if ready():
                    return
                me.wake.clear()
            left = until - time.monotonic()
            if left <= 0:
                return
            me.wake.wait(left)

    def _ended(self, company: tuple, rows: int) -> None:
        """A merged forward of ``company`` (``rows`` rows) ended: its next leader may go."""
        with self._lock:
            self._running.discard(company)
            self._active_rows[company] = rows + self._gathered_rows(company)
            leader = self._leading.get(company)
            if leader is not None:
                leader.wake.set()

    def _take(self, company: tuple) -> list[_Caller]:
        """The waiting callers of ``company``, FIFO, up to max_rows rows (at least one)."""
        batch: list[_Caller] = []
        rows = 0
        for c in self._queue:
            if c.company != company:
                continue
            if batch and rows + c.rows > self.policy.max_rows:
                break
            batch.append(c)
            rows += c.rows
        for c in batch:
            self._queue.remove(c)
            c.taken = True
        return batch

    @staticmethod
    def _forward(
        batch: list[_Caller], call: Callable[[tuple], Any]
    ) -> tuple[list[tuple[Any, BaseException | None]], list[tuple[int, int]]]:
        """Each caller's (output, error), and the forwards run as (callers, rows): one
        merged forward, or one per caller if that fails or its output does not split."""
        if len(batch) > 1:
            merged = tuple(torch.cat([c.args[i] for c in batch]) for i in range(len(batch[0].args)))
            try:
                split = _split_rows(call(merged), [c.rows for c in batch])
            except Exception:
                split = None
            if split is not None:
                return [(out, None) for out in split], [(len(batch), sum(c.rows for c in batch))]
        results: list[tuple[Any, BaseException | None]] = []
        for c in batch:
            try:
                results.append((call(c.args), None))
            except Exception as exc:
                results.append((None, exc))
        return results, [(1, c.rows) for c in batch]
