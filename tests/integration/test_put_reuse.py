"""Puts land in the memory of the value a put just replaced (``worker/receive_pool.py``).

Over the bulk port and over the gRPC stream (``--no-bulk``): two names of the
same size are put in turn with fresh random values, so each put after the
third is received into memory that last held the *other* name's previous
value. Every stored value must read back exactly as last put, and the worker's
``collectives_put_buffers_reused_total`` must count each reuse.
"""

from __future__ import annotations

import pytest
import torch
from helpers import metrics_endpoints, wait_until
from test_metrics import scrape, value

MiB = 1 << 20
ROUNDS = 4  # puts per name


def _reused(port: int) -> float:
    return value(scrape(port), "collectives_put_buffers_reused_total")


@pytest.mark.parametrize("path", ["bulk", "stream"])
def test_puts_reuse_replaced_memory_and_every_value_reads_back(
    fresh_cluster, gen, uname, path
) -> None:
    flags = ["--metrics-port", "0"] + (["--no-bulk"] if path == "stream" else [])
    local, client = fresh_cluster(1, *flags)
    (address,) = wait_until(
        lambda: metrics_endpoints(local.log_path, 1), 30, "the worker's metrics endpoint"
    )["worker"]
    port = int(address.rsplit(":", 1)[1])
    before = _reused(port)
    names = [uname("a"), uname("b")]
    latest: dict[str, torch.Tensor] = {}
    for _ in range(ROUNDS):
        for name in names:
            latest[name] = torch.randn(3 * MiB // 4, generator=gen)  # 3 MiB of float32
            client.put(name, latest[name], rank=0)
    for name in names:
        assert torch.equal(client.get(name, rank=0), latest[name]), name
    # The first three puts found nothing kept (the third is the first to replace
    # a value); each later one found the memory the put before it replaced.
    assert _reused(port) - before == 2 * ROUNDS - 3
