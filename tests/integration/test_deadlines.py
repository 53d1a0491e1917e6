"""A deadline that runs out anywhere in the SDK is ``DeadlineExceeded``, nothing else.

hypothesis picks a public call (the data plane, every collective, coalesced
lists, point-to-point, models, data-parallel forward and backward, train_step),
a payload size that takes each path (inline, the gRPC stream, the bulk port,
shared memory) and a deadline from 1 us to 100 ms, on a real 2-worker cluster.
The call must succeed or raise ``DeadlineExceeded``; after each one the cluster
must still give torch's exact results.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import connect_ready
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives
from collectives import DeadlineExceeded

_SETUP_S = 30.0
# Elements of float32 payloads: inline in the op (64 B), the gRPC stream (256 KiB),
# the bulk port or shared memory (4 MiB; the client decides by size and settings).
SIZES = {"inline": 16, "stream": 64 * 1024, "large": 1 << 20}
_counter = itertools.count()


@pytest.fixture(scope="module")
def clients(local_cluster) -> Iterator[dict[str, collectives.Cluster]]:
    # A lease far above the tests' usual 2 s: this module loads the machine with
    # thousands of calls, and is about deadlines, not failure detection.
    address = local_cluster(
        2, "--allow-factory", "collectives_server.model_zoo", "--lease", "15", "--heartbeat", "0.5"
    )
    plain = connect_ready(address, 2)
    shm = collectives.connect(address, timeout=_SETUP_S, shared_memory=True)
    plain.load_model(
        "dl/mlp",
        factory="collectives_server.model_zoo:mlp",
        kwargs={"in_features": 8, "hidden": 16, "out_features": 4},
        timeout=_SETUP_S,
    )
    yield {"plain": plain, "shm": shm}
    shm.close()
    plain.close()


def _name(tag: str) -> str:
    return f"dl/{tag}/{next(_counter)}"


def _placed(c: collectives.Cluster, numel: int) -> str:
    name = _name("x")
    for rank in range(c.world_size):
        c.put(name, torch.randn(numel), rank=rank, timeout=_SETUP_S)
    return name


def _call_put(c, numel, t):
    c.put(_name("put"), torch.randn(numel), timeout=t)


def _call_put_one(c, numel, t):
    c.put(_name("put1"), torch.randn(numel), rank=1, timeout=t)


def _call_get(c, numel, t):
    c.get(_placed(c, numel), rank=1, timeout=t)


def _call_scatter(c, numel, t):
    c.scatter(_name("sc"), torch.randn(2 * numel), timeout=t)


def _collective(op: str, **kw) -> Callable[[Any, int, float], None]:
    def call(c, numel, t):
        getattr(c, op)(_placed(c, numel), timeout=t, **kw)

    call.__name__ = f"_call_{op}"
    return call


def _call_coalesced(c, numel, t):
    c.all_reduce([_placed(c, numel), _placed(c, numel)], timeout=t)


def _call_barrier(c, numel, t):
    c.barrier(timeout=t)


def _call_send(c, numel, t):
    c.send(_placed(c, numel), src=0, dst=1, timeout=t)


def _call_exchange(c, numel, t):
    c.exchange(_placed(c, numel), pairs=[(0, 1), (1, 0)], timeout=t)


def _call_load_model(c, numel, t):
    c.load_model(
        _name("m"),
        factory="collectives_server.model_zoo:mlp",
        kwargs={"in_features": 8, "hidden": max(1, numel // 64), "out_features": 4},
        timeout=t,
    )


def _call_load_state_dict(c, numel, t):
    state = c.state_dict("dl/mlp", timeout=_SETUP_S)
    c.load_state_dict("dl/mlp", {k: v.clone() for k, v in state.items()}, timeout=t)


def _call_forward(c, numel, t):
    dp = c.data_parallel("dl/mlp", timeout=t)
    with torch.no_grad():
        dp(torch.randn(max(2, numel // 64), 8))


def _call_backward(c, numel, t):
    dp = c.data_parallel("dl/mlp", timeout=t)
    dp(torch.randn(max(2, numel // 64), 8)).sum().backward()


def _call_train_step(c, numel, t):
    rows = max(2, numel // 64)
    x, y = _name("tx"), _name("ty")
    c.scatter(x, torch.randn(2 * rows, 8), timeout=_SETUP_S)
    c.scatter(y, torch.randn(2 * rows, 4), timeout=_SETUP_S)
    c.train_step("dl/mlp", x, y, optimizer="sgd", lr=0.0, timeout=t)


CALLS = [
    _call_put,
    _call_put_one,
    _call_get,
    _call_scatter,
    _collective("all_reduce"),
    _collective("broadcast", src=1),
    _collective("reduce", dst=1),
    _collective("all_gather"),
    _collective("gather", dst=0),
    _collective("reduce_scatter"),
    _collective("all_to_all"),
    _call_coalesced,
    _call_barrier,
    _call_send,
    _call_exchange,
    _call_load_model,
    _call_load_state_dict,
    _call_forward,
    _call_backward,
    _call_train_step,
]


def _assert_exact(c: collectives.Cluster) -> None:
    parts = [torch.randn(33) for _ in range(c.world_size)]
    name = _name("check")
    for rank, part in enumerate(parts):
        c.put(name, part, rank=rank, timeout=_SETUP_S)
    c.all_reduce(name, timeout=_SETUP_S)
    want = torch.stack(parts).sum(0)
    for rank in range(c.world_size):
        torch.testing.assert_close(c.get(name, rank=rank, timeout=_SETUP_S), want)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    call=st.sampled_from(CALLS),
    size=st.sampled_from(sorted(SIZES)),
    path=st.sampled_from(["plain", "shm"]),
    timeout=st.floats(1e-6, 0.1),
)
def test_a_deadline_ends_in_success_or_deadline_exceeded(clients, call, size, path, timeout):
    c = clients[path]
    try:
        call(c, SIZES[size], timeout)
    except DeadlineExceeded as err:  # anything else fails the test
        assert err.code.name == "DEADLINE_EXCEEDED"
    _assert_exact(c)


def test_load_state_dict_given_a_fraction_of_its_time(clients) -> None:
    """The reported case: a publish given a fraction of the time a full one takes
    (its bulk connection found the time already spent)."""
    c = clients["plain"]
    c.load_model(
        "dl/big",
        factory="collectives_server.model_zoo:mlp",
        kwargs={"in_features": 512, "hidden": 2048, "out_features": 512},
        timeout=_SETUP_S,
    )
    state = {k: torch.randn_like(v) for k, v in c.state_dict("dl/big", timeout=_SETUP_S).items()}
    started = time.monotonic()
    c.load_state_dict("dl/big", state, timeout=_SETUP_S)
    full_s = time.monotonic() - started
    outcomes = set()
    for fraction in (0.02, 0.1, 0.25, 0.5, 0.75):
        try:
            c.load_state_dict("dl/big", state, timeout=full_s * fraction)
            outcomes.add("ok")
        except DeadlineExceeded:
            outcomes.add("deadline")
    assert "deadline" in outcomes
    _assert_exact(c)
