"""A forced-on progress bar on a real cluster: a 256 MiB put and get."""

from __future__ import annotations

import torch

import collectives
from collectives._progress import PROGRESS_MIN_BYTES


def test_a_large_put_and_get_draw_bars_to_100_percent(
    cluster2, cluster2_address, gen, uname, capsys
) -> None:
    name = uname("progress")
    t = torch.rand(PROGRESS_MIN_BYTES // 4, generator=gen)  # float32: 256 MiB
    with collectives.connect(cluster2_address, progress=True) as client:
        try:
            client.put(name, t)  # both ranks, sent once (to the leader): one bar of 256 MiB
            back = client.get(name, rank=1)
        finally:
            client.delete(name, missing_ok=True)
    assert torch.equal(back, t)
    err = capsys.readouterr().err
    puts = [line for line in err.replace("\r", "\n").splitlines() if f"put {name!r}" in line]
    gets = [line for line in err.replace("\r", "\n").splitlines() if f"get {name!r}" in line]
    assert puts and "100%" in puts[-1] and "256M/256M" in puts[-1], err[-2000:]
    assert gets and "100%" in gets[-1] and "256M/256M" in gets[-1], err[-2000:]
