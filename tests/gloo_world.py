"""Worlds of real gloo process groups, one per rank thread over one ``HashStore``: the
oracle of ``tests/fake_pg.py`` and the groups the unit tests of the workers' data
collectives run on (the same backend the workers' data groups use)."""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
from fake_pg import run_ranks

__all__ = ["GlooWorlds", "gloo_groups"]


def gloo_groups(size: int, timeout_s: float) -> list[dist.ProcessGroupGloo]:
    """``size`` real gloo groups of one world (built on ``size`` threads, as they rendezvous)."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=timeout_s)
    shim = SimpleNamespace(size=size, pg=lambda rank: None)
    pgs = run_ranks(shim, lambda r, _: dist.ProcessGroupGloo(store, r, size, timeout))
    assert all(isinstance(pg, dist.ProcessGroupGloo) for pg in pgs), pgs
    return pgs


class GlooWorlds:
    """``worlds(size)``: a world (``.size``, ``.pg(rank)``, for ``fake_pg.run_ranks``) of
    real gloo groups, built once per size and kept (a module-scoped fixture holds one)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._worlds: dict[int, Any] = {}

    def __call__(self, size: int) -> Any:
        if size not in self._worlds:
            pgs = gloo_groups(size, self.timeout_s)
            self._worlds[size] = SimpleNamespace(size=size, pg=pgs.__getitem__)
        return self._worlds[size]
