"""``Session.fan_out``: the SDK's one fan-out, whatever road each rank's call takes.

It starts every rank's call from the caller's thread before it waits on any
(so calls sent on lanes or as gRPC futures are in flight together), runs work
that blocks (a ``Job``) on the I/O pool with the last job on the caller's
thread, waits for every call even when one failed, and raises the lowest
rank's error, its message naming the rank.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sdk_fakes import FakeDeployment, start_deployment

from collectives.errors import NotFound, Unavailable
from collectives.session.connection import ClusterSession
from collectives.transport.calls import Done, Job, Mapped


@pytest.fixture(scope="module")
def session() -> Iterator[ClusterSession]:
    deployment: FakeDeployment = start_deployment(world_size=2)
    session = ClusterSession(deployment.coordinator_address, timeout=10)
    yield session
    session.close()
    deployment.stop()


class _Recorded:
    """A started call that records when its answer is awaited."""

    def __init__(self, rank: int, log: list[tuple[str, int]], error: Exception | None = None):
        self.rank, self.log, self.error = rank, log, error

    def result(self) -> int:
        self.log.append(("result", self.rank))
        if self.error is not None:
            raise self.error
        return self.rank * 10


def test_every_call_is_started_before_any_answer_is_awaited(session) -> None:
    log: list[tuple[str, int]] = []

    def start(rank: int):
        def begin() -> _Recorded:
            log.append(("start", rank))
            return _Recorded(rank, log)

        return begin

    got = session.fan_out("op", {r: start(r) for r in range(4)})
    assert got == {0: 0, 1: 10, 2: 20, 3: 30}
    assert log[:4] == [("start", r) for r in range(4)]
    assert sorted(log[4:]) == [("result", r) for r in range(4)]


@pytest.mark.parametrize("given", ["as the start", "by the start (a gRPC call's road)"])
def test_jobs_run_on_the_pool_and_the_last_one_on_the_callers_thread(session, given) -> None:
    caller = threading.get_ident()
    ran_on: dict[int, int] = {}

    def job(rank: int):
        def work() -> int:
            ran_on[rank] = threading.get_ident()
            return rank

        return Job(work) if given == "as the start" else (lambda: Job(work))

    assert session.fan_out("op", {r: job(r) for r in range(3)}) == {0: 0, 1: 1, 2: 2}
    assert ran_on[2] == caller
    assert ran_on[0] != caller and ran_on[1] != caller


def test_jobs_run_at_the_same_time_the_callers_one_too(session) -> None:
    # Each job waits for all the others to be running: run one after another, the
    # barrier breaks (after its timeout) instead of opening.
    barrier = threading.Barrier(3, timeout=20)

    def work(rank: int) -> int:
        barrier.wait()
        return rank

    got = session.fan_out("op", {r: Job(lambda r=r: work(r)) for r in range(3)})
    assert got == {0: 0, 1: 1, 2: 2}


def test_the_lowest_ranks_error_is_raised_once_every_call_ended(session) -> None:
    log: list[tuple[str, int]] = []
    errors = {0: NotFound("tensor 'a' is missing"), 2: Unavailable("worker gone")}

    def start(rank: int):
        return lambda: _Recorded(rank, log, errors.get(rank))

    with pytest.raises(NotFound) as raised:
        session.fan_out("get 'a'", {r: start(r) for r in (2, 1, 0)})
    assert raised.value.message.startswith("get 'a' on rank 0: ")
    assert sorted(r for kind, r in log if kind == "result") == [0, 1, 2]


def test_a_call_that_fails_to_start_is_that_ranks_failure_only(session) -> None:
    started: list[int] = []

    def start(rank: int):
        def begin():
            started.append(rank)
            if rank == 1:
                raise Unavailable("the lane broke before the request was sent")
            return Mapped(Done(rank), lambda value: value + 100)

        return begin

    with pytest.raises(Unavailable, match="on rank 1: the lane broke"):
        session.fan_out("op", {r: start(r) for r in range(3)})
    assert started == [0, 1, 2]
