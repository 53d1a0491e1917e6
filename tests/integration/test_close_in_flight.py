"""``cluster.close()`` from another thread ends the calls in flight with ``Unavailable``.

Never ``DeadlineExceeded``: nothing timed out, and a ``TimeoutError`` invites a
retry that a closed handle cannot serve. The calls are kept in flight for
certain by stopping rank 1 (SIGSTOP, inside a lease long enough that the
membership does not change): a collective then waits at the leader (the
observer's flight record shows it running), a ``get`` from rank 1 waits for
its answer (the caller's thread is seen blocked in the transport). Each is
repeated with fresh data, on call lanes and on plain gRPC.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers import wait_until
from launcher import stop_process

import collectives

# Long enough that a stopped worker is not declared lost while a test runs.
FLAGS = ("--lease", "120", "--op-timeout-s", "120")
WAIT_S = 30.0
ROUNDS = 3


def _members(cluster: Any) -> list[Any]:
    return sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)


@contextmanager
def _stopped(local: Any, pid: int) -> Iterator[None]:
    assert local.owns(pid), f"pid {pid} is not one of this cluster's processes"
    stop_process(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


class _Call:
    """``fn()`` on its own thread; what it returned or raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.error: BaseException | None = None
        self.result: Any = None
        self.seen_in: str = ""  # the transport frame in_transport() found it waiting in
        self.done = threading.Event()

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # checked by the test's thread
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def in_transport(self) -> bool:
        """Whether the thread waits inside an RPC (gRPC's channel, a lane, a bulk read)."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        while frame is not None:
            path = frame.f_code.co_filename.replace(os.sep, "/")
            if "/grpc/" in path or path.endswith(("/collectives/lanes.py", "/collectives/bulk.py")):
                self.seen_in = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
                return True
            frame = frame.f_back
        return False


def _assert_closed_error(call: _Call) -> None:
    assert call.done.wait(WAIT_S), "close() did not end the call in flight"
    assert isinstance(call.error, collectives.Unavailable), (
        f"{call.error!r}; returned {type(call.result).__name__} "
        f"{getattr(call.result, 'shape', '')}; seen waiting in {call.seen_in}"
    )
    assert not isinstance(call.error, TimeoutError), repr(call.error)
    assert "closed" in call.error.message, call.error.message


def _running(observer: Any, name: str) -> bool:
    """The leader's flight record shows an op on ``name`` in flight."""
    records = observer.flight_record(last=50, ranks=[0], timeout=5)
    return any(r.names == (name,) and r.outcome == "in flight" for r in records)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["lanes", "grpc"])
def test_close_ends_a_collective_in_flight_with_unavailable(fresh_cluster, uname, gen, path):
    extra = ("--no-call-lanes", "--no-bulk") if path == "grpc" else ()
    local, observer = fresh_cluster(2, *FLAGS, *extra)
    victim = _members(observer)[1]
    for _ in range(ROUNDS):
        name, queued = uname("x"), uname("queued")
        parts = [torch.randn(64, generator=gen) for _ in range(2)]
        for rank, part in enumerate(parts):
            observer.put(name, part, rank=rank)
            observer.put(queued, part, rank=rank)
        client = collectives.connect(local.address, timeout=60)
        with _stopped(local, victim.pid):
            call = _Call(lambda c=client, n=name: c.all_reduce(n))
            wait_until(lambda n=name: _running(observer, n), WAIT_S, f"all_reduce {name} to run")
            # Behind it: async ops, queued at the leader or on the client's op thread.
            works = [client.all_reduce(queued, async_op=True) for _ in range(2)]
            client.close()
            _assert_closed_error(call)
            for work in works:
                with pytest.raises(collectives.Unavailable, match="closed"):
                    work.result(timeout=WAIT_S)
        # The op the closed client sent still ran, once rank 1 resumed.
        wait_until(lambda n=name: not _running(observer, n), WAIT_S, f"all_reduce {name} to finish")
        torch.testing.assert_close(observer.get(name, rank=1, timeout=WAIT_S), parts[0] + parts[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["bulk", "grpc"])
def test_close_ends_a_get_in_flight_with_unavailable(fresh_cluster, uname, gen, path):
    extra = ("--no-call-lanes", "--no-bulk") if path == "grpc" else ()
    local, observer = fresh_cluster(2, *FLAGS, *extra)
    victim = _members(observer)[1]
    for _ in range(ROUNDS):
        name = uname("g")
        t = torch.randn(1 << 16, generator=gen)
        observer.put(name, t, rank=1)
        client = collectives.connect(local.address, timeout=60)
        torch.testing.assert_close(client.get(name, rank=1, timeout=WAIT_S), t)  # paths open
        with _stopped(local, victim.pid):
            call = _Call(lambda c=client, n=name: c.get(n, rank=1))
            wait_until(call.in_transport, WAIT_S, f"get {name} to wait on rank 1")
            client.close()
            _assert_closed_error(call)
        torch.testing.assert_close(observer.get(name, rank=1, timeout=WAIT_S), t)
