"""The dynamic batcher in one process: merging, splitting, failing alone, the policy."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from torch import nn

from collectives.errors import InvalidArgument
from collectives.wire.batching import Batching
from collectives_server.worker.models.batching import Batcher, company_of


def test_batching_policy_is_checked_and_travels() -> None:
    assert Batching() == Batching(256, 0.0)
    assert Batching.from_proto(Batching(8, 2.5).to_proto()) == Batching(8, 2.5)
    assert Batching.parse("64") == Batching(64, 0.0)
    assert Batching.parse("64:2") == Batching(64, 2.0)
    for bad in ({"max_rows": 0}, {"max_rows": 1.5}, {"max_rows": True}):
        with pytest.raises(InvalidArgument, match="max_rows"):
            Batching(**bad)
    for delay in (-1.0, float("nan"), float("inf"), 1e9, "2"):
        with pytest.raises(InvalidArgument, match="max_delay_ms"):
            Batching(max_delay_ms=delay)
    with pytest.raises(InvalidArgument, match="MAX_ROWS"):
        Batching.parse("many")
    with pytest.raises(InvalidArgument, match=r"max_rows must be in 1\.\."):
        Batching.parse("0:2")


def test_company_of_mergeable_inputs_only() -> None:
    x = torch.zeros(3, 4)
    assert company_of((x,), {}) == (3, ((torch.float32, (4,), x.device),))
    assert company_of((x, torch.zeros(3)), {})[0] == 3
    assert company_of((x, torch.zeros(2)), {}) is None  # dim 0 disagrees
    assert company_of((x,), {"y": x}) is None
    assert company_of((x, 2), {}) is None
    assert company_of((torch.zeros(()),), {}) is None
    assert company_of((torch.zeros(0, 4),), {}) is None


class _Model:
    """A linear model held under a lock, counting the forwards it ran."""

    def __init__(self) -> None:
        self.module = nn.Linear(4, 3)
        self.lock = threading.Lock()
        self.runs: list[int] = []

    @contextlib.contextmanager
    def hold(self):
        with self.lock:
            yield 7, self.module

    def call(self, module: nn.Module, args: tuple) -> torch.Tensor:
        assert module is self.module
        (x,) = args
        if x.shape[1] != 4:
            raise InvalidArgument("bad shape")
        self.runs.append(x.shape[0])
        with torch.no_grad():
            return module(x)


def _callers(batcher: Batcher, model: _Model, inputs: list[torch.Tensor]) -> list:
    results: list = [None] * len(inputs)
    start = threading.Barrier(len(inputs))

    def one(i: int) -> None:
        x = inputs[i]
        start.wait()
        merged = company_of((x,), {})
        assert merged is not None
        try:
            results[i] = batcher.run(
                (x,), (0, merged[1]), merged[0], model.hold, model.call, time.monotonic() + 30
            )
        except InvalidArgument as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(inputs))]
    with model.lock:  # the callers gather while the model is busy
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=0.2)
    for t in threads:
        t.join(timeout=30)
    return results


def test_merged_forwards_split_back_exactly_and_a_bad_caller_fails_alone() -> None:
    model = _Model()
    batcher = Batcher(Batching(max_rows=64, max_delay_ms=50.0))
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(n, 4, generator=gen) for n in (1, 5, 9, 20)]
    inputs.append(torch.randn(3, 5, generator=gen))  # malformed: its own company
    results = _callers(batcher, model, inputs)
    for x, result in zip(inputs[:-1], results[:-1], strict=True):
        out, version = result
        assert version == 7
        with torch.no_grad():
            torch.testing.assert_close(out, model.module(x), atol=1e-6, rtol=1e-6)
    assert isinstance(results[-1], InvalidArgument)
    stats = batcher.stats()
    assert stats.calls == 5 and stats.rows == 38  # the failed forward ran too
    assert stats.batches == 2 and stats.largest_rows == 35


def test_max_rows_bounds_a_merged_forward() -> None:
    model = _Model()
    batcher = Batcher(Batching(max_rows=10, max_delay_ms=20.0))
    inputs = [torch.ones(4, 4)] * 6 + [torch.ones(30, 4)]
    results = _callers(batcher, model, inputs)
    assert all(not isinstance(r, Exception) for r in results)
    assert max(model.runs) == 30  # a caller beyond max_rows runs alone
    assert all(n <= 10 for n in model.runs if n != 30)
    assert sum(model.runs) == 54


def test_many_rounds_of_callers_each_get_their_own_rows() -> None:
    model = _Model()
    batcher = Batcher(Batching(max_rows=40, max_delay_ms=1.0))
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(25):
                x = torch.randn(int(torch.randint(1, 30, (1,), generator=gen)), 4, generator=gen)
                rows, company = company_of((x,), {})
                out, _ = batcher.run(
                    (x,), (0, company), rows, model.hold, model.call, time.monotonic() + 30
                )
                with torch.no_grad():
                    torch.testing.assert_close(out, model.module(x), atol=1e-6, rtol=1e-6)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:1]
    stats = batcher.stats()
    assert stats.calls == 12 * 25 and stats.batches < stats.calls
    assert stats.largest_rows <= 40  # every caller has fewer rows than max_rows


def test_callers_in_flight_fill_one_forward_instead_of_running_in_waves() -> None:
    """Eight callers, each calling again as soon as it is answered, on a model that runs
    concurrent forwards (read-only, as the worker holds it) and takes 30 ms per forward;
    half of them start 12 ms after the others, as callers' round trips differ. One
    merged forward runs at a time, and the next waits for the callers just answered (up
    to max_delay_ms) instead of running the half that queued meanwhile beside it: the
    two waves merge into one instead of alternating for good."""
    module = nn.Linear(4, 3)
    rows_per_forward: list[int] = []
    running, most_at_once = [0], [0]
    counting = threading.Lock()

    @contextlib.contextmanager
    def hold():
        yield 7, module  # shared: forwards may overlap, as eval forwards do on a worker

    def call(m: nn.Module, args: tuple) -> torch.Tensor:
        (x,) = args
        with counting:
            rows_per_forward.append(x.shape[0])
            running[0] += 1
            most_at_once[0] = max(most_at_once[0], running[0])
        time.sleep(0.03)  # the model's own time (a memory-bound forward), GIL released
        with counting:
            running[0] -= 1
        with torch.no_grad():
            return m(x)

    # A queue delay far shorter than a forward: with the old rule the second wave then
    # ran beside the first for good.
    batcher = Batcher(Batching(max_rows=64, max_delay_ms=5))
    callers, calls = 8, 12
    start = threading.Barrier(callers)
    wrong: list[str] = []

    def caller(i: int) -> None:
        start.wait(timeout=30)
        if i % 2:
            time.sleep(0.012)  # the second wave: arrivals, not synchronisation
        for k in range(calls):
            x = torch.full((1, 4), float(i * 100 + k))
            merged = company_of((x,), {})
            assert merged is not None
            rows, company = merged
            out, _ = batcher.run((x,), (0, company), rows, hold, call, time.monotonic() + 30)
            with torch.no_grad():
                want = module(x)
            if not torch.allclose(out, want):
                wrong.append(f"caller {i} call {k}")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert wrong == []
    assert sum(rows_per_forward) == callers * calls
    assert most_at_once[0] == 1, "two merged forwards of one company ran at once"
    steady = rows_per_forward[2:]
    assert sum(steady) / len(steady) >= 5, rows_per_forward
