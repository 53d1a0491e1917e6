"""Where a small request runs: workers chosen by load, by the power of two choices.

``dp(x)`` splits a batch across the workers as ``nn.DataParallel`` splits it
across devices, and a batch too small to give every worker a part (fewer parts
than members: one row on two workers) uses only some of them. Those used to be
the first ranks, so a fleet's small requests all ran on rank 0. A forward
that only reads the model (no autograd), of a model whose replicas are the same
on every worker and that keeps no per-worker statistics (batch norm's running
ones), has its parts placed here instead: for each part, two members drawn at
random, the less loaded taken when it is lighter by :data:`LOAD_MARGIN` or
more, else the first drawn (Ray Serve's and Mitzenmacher's power of two
choices: near the best spread, without every client herding to the one worker
that looked idlest).

A worker's load, as this client sees it: the forwards this client has in
flight to it, plus the other forwards the worker said it was running or
queueing when it last answered this client (``ForwardResponse.forwards_in_flight``),
for :data:`REPORT_TTL_S` after that answer.
A worker that fails a routed call with ``UNAVAILABLE`` is avoided for
:data:`AVOID_S` seconds (unless every member is), and the call, which had no
side effect, is placed again within its deadline.

Replicas are the same everywhere once a model is loaded or published whole; an
optimizer step (``Cluster.step``) may make them differ, and every worker then
says so in its answers (``ForwardResponse.replicas_may_differ``) until the next
whole publish. A model's small forwards are placed by load only once an answer
said its replicas are the same, and not after one said they may differ: then
they run on the ranks a split would use, as before.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from collectives.wire.cluster_state import WorkerInfo

__all__ = ["AVOID_S", "Placement"]

# How long a worker that failed a routed call is left out of placements.
AVOID_S = 5.0
# Of two workers drawn, the less loaded is taken when it is lighter by this many
# forwards or more; closer than that the draw decides. Loads are small counts sampled
# when a worker answered, and a worker a shade faster would otherwise draw most of the
# traffic from workers just as able to serve it.
LOAD_MARGIN = 2
# A worker's reported load counts this long after its answer: a few small calls. A
# client stops drawing traffic to a worker that reported a burst, and so stops hearing
# from it; a report kept longer held a worker out of the client's choices long after
# the burst (one hiccup of one worker then skewed the shares by half). A worker that
# stays loaded keeps reporting it.
REPORT_TTL_S = 0.05


@dataclass
class _Load:
    in_flight: int = 0  # this client's forwards to the worker, not yet answered
    reported: int = 0  # the others the worker had in flight at its last answer here
    reported_at: float = 0.0
    avoid_until: float = 0.0


class Placement:
    """One client's view of its workers' load, and its choices (thread-safe)."""

    def __init__(self, seed: int | None = None) -> None:
        self._lock = threading.Lock()
        self._loads: dict[str, _Load] = {}
        self._random = random.Random(seed)
        # Per model: whether the last answer said its replicas may differ.
        self._replicas_differ: dict[str, bool] = {}

    def may_route(self, model: str) -> bool:
        """Whether ``model``'s small forwards may run on any worker: an answer said its
        replicas are the same everywhere, and none said otherwise since."""
        with self._lock:
            return self._replicas_differ.get(model) is False

    def replicas(self, model: str, may_differ: bool) -> None:
        """A worker answered a forward of ``model`` saying whether its replicas may differ."""
        with self._lock:
            self._replicas_differ[model] = may_differ

    def choose(self, members: Sequence[WorkerInfo], parts: int) -> list[WorkerInfo]:
        """``parts`` distinct members (``parts`` <= ``len(members)``) to run one part each,
        each the clearly less loaded of two drawn among those not chosen yet and not
        avoided (see the module)."""
        if not 0 < parts <= len(members):
            raise ValueError(f"cannot place {parts} parts on {len(members)} members")
        now = time.monotonic()
        with self._lock:
            usable = [w for w in members if self._load(w.address).avoid_until <= now]
            if len(usable) < parts:
                usable = list(members)  # every worker looks unwell: try them all
            chosen: list[WorkerInfo] = []
            for _ in range(parts):
                pick, *other = self._random.sample(usable, min(2, len(usable)))
                if other:
                    lighter_by = self._weight(pick.address, now) - self._weight(
                        other[0].address, now
                    )
                    if lighter_by >= LOAD_MARGIN:
                        pick = other[0]
                usable.remove(pick)
                chosen.append(pick)
            return chosen

    @contextmanager
    def sending(self, addresses: Sequence[str]) -> Iterator[None]:
        """Counts a forward in flight to each of ``addresses`` while the block runs."""
        with self._lock:
            for address in addresses:
                self._load(address).in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                for address in addresses:
                    self._load(address).in_flight -= 1

    def reported(self, address: str, in_flight: int) -> None:
        """The worker at ``address`` had ``in_flight`` other forwards when it answered."""
        with self._lock:
            load = self._load(address)
            load.reported, load.reported_at = max(0, in_flight), time.monotonic()

    def avoid(self, address: str) -> None:
        """Leaves ``address`` out of placements for :data:`AVOID_S` seconds."""
        with self._lock:
            load = self._load(address)
            load.avoid_until = time.monotonic() + AVOID_S
            load.reported = 0

    def _weight(self, address: str, now: float) -> int:
        load = self._load(address)
        fresh = now - load.reported_at < REPORT_TTL_S
        return load.in_flight + (load.reported if fresh else 0)

    def _load(self, address: str) -> _Load:
        load = self._loads.get(address)
        if load is None:
            load = self._loads[address] = _Load()
        return load
