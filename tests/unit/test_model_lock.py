"""The hosted model's lock: forwards that only read share it; whatever changes the
model holds it alone, and a stream of readers cannot starve it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from collectives.errors import CollectiveError
from collectives_server.worker.models import versions as model_versions
from collectives_server.worker.models.model_lock import ModelLock
from collectives_server.worker.models.registry import HostedModel

_WAIT_S = 10.0


def _shared(lock: ModelLock):
    with lock.admitted():
        lock.join()


def test_shared_holders_run_at_once_and_an_exclusive_one_waits_for_them() -> None:
    lock = ModelLock()
    both_inside = threading.Barrier(2, timeout=_WAIT_S)
    release = threading.Event()

    def reader() -> None:
        _shared(lock)
        try:
            both_inside.wait()  # breaks (and fails the test) unless both are inside at once
            assert release.wait(_WAIT_S)
        finally:
            lock.leave()

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + _WAIT_S
    while lock.acquire(blocking=False):  # free until the readers are in
        lock.release()
        assert time.monotonic() < deadline, "the readers never held the lock"
    acquired = threading.Event()

    def writer() -> None:
        with lock:
            acquired.set()

    w = threading.Thread(target=writer)
    w.start()
    assert not acquired.wait(0.2), "the exclusive holder ran beside shared ones"
    release.set()
    assert acquired.wait(_WAIT_S)
    for t in [*readers, w]:
        t.join(_WAIT_S)
        assert not t.is_alive()


def test_a_waiting_exclusive_holder_is_not_starved_by_new_readers() -> None:
    lock = ModelLock()
    _shared(lock)  # one reader holds it
    order: list[str] = []
    writer_waiting = threading.Event()

    def writer() -> None:
        writer_waiting.set()
        with lock:
            order.append("writer")

    def late_reader() -> None:
        _shared(lock)
        order.append("reader")
        lock.leave()

    w = threading.Thread(target=writer)
    w.start()
    assert writer_waiting.wait(_WAIT_S)
    deadline = time.monotonic() + _WAIT_S
    while not lock.exclusive_waiting:  # the writer waits for the reader to leave
        assert time.monotonic() < deadline, "the writer never waited for the reader"
        writer_waiting.wait(0.001)
    r = threading.Thread(target=late_reader)
    r.start()
    lock.leave()  # the first reader leaves: the writer goes first, then the late reader
    for t in (w, r):
        t.join(_WAIT_S)
        assert not t.is_alive()
    assert order == ["writer", "reader"]


def test_a_shared_forward_waits_for_the_version_it_names_and_runs_on_it() -> None:
    model = HostedModel("m", nn.Linear(3, 2).eval(), "test", [torch.device("cpu")])
    got: list[int] = []

    def forward() -> None:
        deadline = time.monotonic() + _WAIT_S
        with model_versions.serving(model, 2, deadline, False, shared=True) as (version, m):
            assert m is model.module
            got.append(version)

    t = threading.Thread(target=forward)
    t.start()
    staged = {k: v.clone() + 1 for k, v in model.module.state_dict().items()}
    with model.lock:
        model_versions.commit(model, staged, 2)
    t.join(_WAIT_S)
    assert not t.is_alive() and got == [2]
    moved = model_versions.serving(model, 1, time.monotonic() + 1, False, shared=True)
    with pytest.raises(CollectiveError, match="moved from version 1 to 2"), moved:
        pass


def test_a_shared_forward_switches_the_mode_only_when_nobody_runs_the_model() -> None:
    model = HostedModel("m", nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)), "test", [])
    model.training = True
    with model_versions.serving(model, 0, time.monotonic() + _WAIT_S, False, shared=True) as (
        _,
        module,
    ):
        assert not module.training  # switched on the way in
        # Another reader in the same mode joins without waiting for this one.
        with model_versions.serving(model, 0, time.monotonic() + _WAIT_S, False, shared=True):
            pass
    assert model.training is True  # a call's own mode leaves the recorded mode as it was


def test_graphs_can_be_expired_beside_shared_forwards_but_not_beside_a_writer() -> None:
    lock = ModelLock()
    _shared(lock)  # a forward runs
    assert lock.try_admit(), "a shared holder blocked the expiry of graphs"
    lock.release()
    lock.leave()
    held = threading.Event()
    done = threading.Event()

    def writer() -> None:
        with lock:
            held.set()
            assert done.wait(_WAIT_S)

    w = threading.Thread(target=writer)
    w.start()
    assert held.wait(_WAIT_S)
    try:
        assert not lock.try_admit(), "admitted beside an exclusive holder"
    finally:
        done.set()
        w.join(_WAIT_S)
    assert not w.is_alive()
    assert lock.try_admit()
    lock.release()
