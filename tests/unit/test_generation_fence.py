"""The store's commit fences: a read, put or delete of a name with a pending write waits for it.

This is what lets a follower serve a client that read it right after the leader
answered (the leader does not wait for every rank's commit): the follower fences
the result's name before its last exchange of the op, so the read waits for the
commit instead of returning the value from before the op.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import wait_until

from collectives_server.worker.data.store import TensorStore


def _reader(store: TensorStore, name: str, method: str = "get") -> tuple[threading.Thread, list]:
    got: list = []

    def read() -> None:
        got.append(store.get(name) if method == "get" else store.infos())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, got


def test_get_of_a_fenced_name_waits_for_the_commit() -> None:
    store = TensorStore(torch.device("cpu"))
    store.put("y", torch.zeros(3))
    fence = store.fence("y", timeout_s=30)
    reader, got = _reader(store, "y")
    wait_until(lambda: store.readers_waiting() == 1, 10, "the read to wait on the fence")
    assert reader.is_alive() and not got  # not served the value from before the op
    store.replace("y", torch.ones(3))  # the commit (OpContext.commit)
    fence.release()
    reader.join(10)
    assert torch.equal(got[0], torch.ones(3))
    assert store.fenced() == [] and store.readers_waiting() == 0


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_a_put_to_a_fenced_name_lands_after_the_commit_not_under_it() -> None:
    """A client's put issued once the leader answered reaches a follower whose commit
    of the op's result is still on its way: the put must win, as it came later."""
    store = TensorStore(torch.device("cpu"))
    store.put("x", torch.zeros(3))
    fence = store.fence("x", timeout_s=30)
    put = _in_thread(lambda: store.put("x", torch.full((3,), 5.0)))
    wait_until(lambda: store.readers_waiting() == 1, 10, "the put to wait on the fence")
    assert put.is_alive() and torch.equal(store.peek("x"), torch.zeros(3))
    store.replace("x", torch.ones(3))  # the commit
    fence.release()
    put.join(10)
    assert torch.equal(store.get("x"), torch.full((3,), 5.0))
    # The same for several names at once (a forward's named outputs).
    fence = store.fence("x", timeout_s=30)
    many = _in_thread(lambda: store.put_many({"x": torch.full((3,), 6.0), "z": torch.ones(1)}))
    wait_until(lambda: store.readers_waiting() == 1, 10, "put_many to wait on the fence")
    store.replace("x", torch.ones(3))
    fence.release()
    many.join(10)
    assert torch.equal(store.get("x"), torch.full((3,), 6.0))


def test_a_delete_of_a_fenced_name_deletes_the_committed_value() -> None:
    store = TensorStore(torch.device("cpu"))
    store.put("d", torch.zeros(2))
    fence = store.fence("d", timeout_s=30)
    deleted: list[bool] = []
    delete = _in_thread(lambda: deleted.append(store.delete("d")))
    wait_until(lambda: store.readers_waiting() == 1, 10, "the delete to wait on the fence")
    store.replace("d", torch.ones(2))
    fence.release()
    delete.join(10)
    assert deleted == [True] and store.peek("d") is None


def test_listing_waits_for_every_fence_and_peek_never_waits() -> None:
    store = TensorStore(torch.device("cpu"))
    store.put("x", torch.zeros(2))
    fence = store.fence("new", timeout_s=30)
    assert store.peek("x") is not None and store.peek("new") is None  # the executor's view
    reader, got = _reader(store, "", method="infos")
    wait_until(lambda: store.readers_waiting() == 1, 10, "the listing to wait on the fence")
    store.replace("new", torch.ones(4))
    fence.release()
    reader.join(10)
    assert [i.name for i in got[0]] == ["new", "x"]


def test_other_names_are_not_held_up_and_a_failed_op_leaves_the_old_value() -> None:
    store = TensorStore(torch.device("cpu"))
    store.put("a", torch.zeros(1))
    store.put("b", torch.full((1,), 7.0))
    with store.fence("a", timeout_s=30):
        assert torch.equal(store.get("b"), torch.full((1,), 7.0))  # no wait
        reader, got = _reader(store, "a")
        wait_until(lambda: store.readers_waiting() == 1, 10, "the read to wait on the fence")
    # The op gave up (the fence lifted without a commit): the read gets the old value.
    reader.join(10)
    assert torch.equal(got[0], torch.zeros(1))


def test_a_fence_outliving_its_timeout_no_longer_holds_reads() -> None:
    store = TensorStore(torch.device("cpu"))
    store.put("s", torch.zeros(1))
    fence = store.fence("s", timeout_s=0.0)  # a stuck op whose commit never comes
    assert torch.equal(store.get("s"), torch.zeros(1))
    fence.release()
    fence.release()  # idempotent
    assert store.fenced() == []


def test_fences_on_one_name_nest() -> None:
    store = TensorStore(torch.device("cpu"))
    first = store.fence("n", timeout_s=30)
    second = store.fence("n", timeout_s=30)
    first.release()
    assert store.fenced() == ["n"]
    second.release()
    assert store.fenced() == []


def test_quota_state_is_what_another_rank_needs_to_judge_a_result() -> None:
    store = TensorStore(torch.device("cpu"), limit_bytes=100)
    store.put("t", torch.zeros(10, dtype=torch.uint8))
    store.put("u", torch.zeros(20, dtype=torch.uint8))
    assert store.quota_state("t") == (20, 100)  # t's own bytes would be replaced
    assert store.quota_state("v") == (30, 100)
    assert TensorStore(torch.device("cpu")).quota_state("t") == (0, -1)


@pytest.mark.parametrize("timeout_s", [30.0])
def test_release_wakes_every_waiting_reader(timeout_s: float) -> None:
    store = TensorStore(torch.device("cpu"))
    store.put("w", torch.zeros(1))
    fence = store.fence("w", timeout_s)
    readers = [_reader(store, "w") for _ in range(3)]
    wait_until(lambda: store.readers_waiting() == 3, 10, "three reads to wait")
    store.replace("w", torch.ones(1))
    fence.release()
    for thread, got in readers:
        thread.join(10)
        assert torch.equal(got[0], torch.ones(1))
