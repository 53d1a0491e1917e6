"""Two clients changing one cluster's models at once: every answer each of them gets
is the one torch computes locally for the state the service says it is in.

Each test runs the race a few times with fresh random data and compares every rank
with a local torch oracle (the factory's own weights, the optimizer's own steps).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import collectives
from collectives_server import model_zoo

pytestmark = pytest.mark.timeout(180)

ZOO = "collectives_server.model_zoo:mlp"


def _together(*calls: Callable[[], object]) -> list[object]:
    """Runs ``calls`` at once, one thread each, from one barrier; their results (an
    exception is the test's finding and is raised)."""
    start = threading.Barrier(len(calls))
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, call: Callable[[], object]) -> None:
        start.wait(30)
        try:
            results[i] = call()
        except BaseException as exc:  # raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a call did not return"
    if errors:
        raise errors[0]
    return results


def test_factories_loaded_at_once_build_their_own_weights_on_every_rank(
    cluster3, cluster3_address, uname
) -> None:
    """A factory seeds torch's one process-wide generator to build its weights: two
    builds at once on one worker (two clients loading two models) drew from each
    other's stream, and a rank served weights of neither seed."""
    kwargs = {"in_features": 256, "hidden": 256, "out_features": 64, "depth": 4}
    names = [uname("rngA"), uname("rngB")]
    seeds = [int(s) for s in torch.randint(0, 2**20, (2,))]
    wanted = [model_zoo.mlp(**kwargs, seed=s).state_dict() for s in seeds]
    with collectives.connect(cluster3_address, timeout=60) as other:
        clients = (cluster3, other)
        for _ in range(4):
            _together(
                *(
                    lambda c=c, n=n, s=s: c.load_model(n, factory=ZOO, kwargs={**kwargs, "seed": s})
                    for c, n, s in zip(clients, names, seeds, strict=True)
                )
            )
            for name, want in zip(names, wanted, strict=True):
                for rank in range(cluster3.world_size):
                    got = cluster3.state_dict(name, rank=rank)
                    for key, value in want.items():
                        assert torch.equal(got[key], value), f"{name} {key} on rank {rank}"
    for name in names:
        cluster3.unload_model(name)
