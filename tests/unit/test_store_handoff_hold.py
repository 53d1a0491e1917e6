"""A store closed for a drain's handoff: the drained worker's refuses clients at once,
the successor's holds them until the copy is installed (bounded in time and in calls).
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import assert_tensor, wait_until

from collectives.errors import Unavailable
from collectives_server.worker.data import store as store_module
from collectives_server.worker.data.store import MAX_HELD_CALLS, TensorStore


def _store() -> TensorStore:
    return TensorStore(torch.device("cpu"))


def _held(store: TensorStore, call) -> tuple[threading.Thread, dict]:
    """Runs ``call(store)`` on a thread; what it returned or raised lands in the dict."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call(store)
        except Exception as exc:  # the test's finding
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_drained_store_refuses_at_once() -> None:
    store = _store()
    store.put("t", torch.randn(5))
    store.close_for_handoff("drained: rank 0 now belongs to B; retry")
    with pytest.raises(Unavailable, match="drained"):
        store.get("t")
    with pytest.raises(Unavailable, match="drained"):
        store.put("t", torch.randn(5))


def test_a_successors_store_holds_a_call_until_the_copy_is_installed() -> None:
    store = _store()
    store.close_for_handoff("rank 0 is being handed over; retry shortly", hold=True)
    value = torch.randn(17)
    copied = {"resident": torch.randn(9)}
    putter, put_outcome = _held(store, lambda s: s.put("mine", value))
    getter, get_outcome = _held(store, lambda s: s.get("resident"))
    wait_until(lambda: store.held_calls == 2, 10, "both calls to be held")
    assert put_outcome == {} and get_outcome == {}
    # The handoff ends: its copy becomes the store, then the store opens.
    store.install(copied)
    store.reopen()
    putter.join(10)
    getter.join(10)
    assert "error" not in put_outcome and "error" not in get_outcome, (put_outcome, get_outcome)
    # The put landed after the install (not wiped by it); the get saw the copy.
    assert_tensor(store.get("mine"), value)
    assert_tensor(get_outcome["value"], copied["resident"])
    assert store.held_calls == 0


def test_a_hold_is_bounded_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "HANDOFF_HOLD_S", 0.05)
    store = _store()
    store.close_for_handoff("rank 0 is being handed over; retry shortly", hold=True)
    with pytest.raises(Unavailable, match="being handed over"):
        store.get("anything")
    assert store.held_calls == 0


def test_calls_beyond_the_held_cap_are_refused_at_once() -> None:
    store = _store()
    store.close_for_handoff("rank 0 is being handed over; retry shortly", hold=True)
    held = [_held(store, lambda s: s.get("t")) for _ in range(MAX_HELD_CALLS)]
    wait_until(lambda: store.held_calls == MAX_HELD_CALLS, 10, "the cap's worth of calls held")
    with pytest.raises(Unavailable, match="being handed over"):
        store.get("t")  # one more: refused without waiting (each holds a server thread)
    store.install({"t": torch.randn(3)})
    store.reopen()
    for thread, outcome in held:
        thread.join(10)
        assert "value" in outcome, outcome


def test_calls_held_for_a_handoff_that_is_called_off_are_refused() -> None:
    """The rank stays where it was: a put let through then would land on a worker that
    does not hold it, and a get would read nothing that is the rank's."""
    store = _store()
    store.close_for_handoff("rank 0 is being handed over; retry shortly", hold=True)
    putter, put_outcome = _held(store, lambda s: s.put("mine", torch.randn(4)))
    getter, get_outcome = _held(store, lambda s: s.get("resident"))
    wait_until(lambda: store.held_calls == 2, 10, "both calls to be held")
    store.reopen()  # called off: nothing installed
    putter.join(10)
    getter.join(10)
    for outcome in (put_outcome, get_outcome):
        assert isinstance(outcome.get("error"), Unavailable), outcome
        assert "called off" in str(outcome["error"])
    assert store.peek("mine") is None
    # As a spare again it serves whoever calls it, as before the handoff.
    store.put("later", torch.randn(2))
    assert store.peek("later") is not None
