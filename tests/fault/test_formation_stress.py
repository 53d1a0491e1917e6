"""One generation number, one membership: clusters formed over and over with workers
registering at offsets around the join window, on the memory store and on three
coordinators sharing a real etcd (see formation_stress.py for the checks).

One formation of each kind of arrival here (``EVERY_KIND``: all at once, the third
worker inside the window, at its edge, just after, long after); run the module
as a script for hundreds at random offsets.
"""

from __future__ import annotations

import pytest
from etcd_server import EtcdServer
from formation_stress import EVERY_KIND, run_formations

_BUDGET_S = 60 * len(EVERY_KIND) + 60


def _check(results) -> None:
    wrong = [r for r in results if not r.ok]
    assert not wrong, "\n".join(
        f"offsets {r.offsets}: generation {r.generation}, world {r.world_size}: "
        + "; ".join(r.problems)
        for r in wrong
    )


@pytest.mark.timeout(_BUDGET_S)
def test_formations_on_the_memory_store() -> None:
    _check(run_formations("memory", list(EVERY_KIND)))


@pytest.mark.timeout(_BUDGET_S)
def test_formations_on_three_coordinators_over_etcd(tmp_path) -> None:
    etcd = EtcdServer(tmp_path / "etcd")
    try:
        results = run_formations("etcd", list(EVERY_KIND), etcd_url=etcd.url)
    finally:
        etcd.stop()
    _check(results)
