"""Puts and op results land in the memory of a value just replaced
(``worker/replaced_memory.py``).

Over the bulk port and over the gRPC stream (``--no-bulk``): two names of the
same size are put in turn with fresh random values, so each put after the
third is received into memory that last held the *other* name's previous
value. Every stored value must read back exactly as last put, and the worker's
``collectives_put_buffers_reused_total`` must count each reuse. A replicated put
reuses memory on every rank: the leader's upload lands where its previous
upload was, a follower's broadcast result where its previous result was
(``collectives_result_buffers_reused_total``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import metrics_endpoints, wait_until
from test_metrics import scrape, value

MiB = 1 << 20
ROUNDS = 4  # puts per name


def _reused(port: int, what: str = "put") -> float:
    return value(scrape(port), f"collectives_{what}_buffers_reused_total")


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


def test_a_replicated_put_lands_in_the_memory_each_rank_replaced(fresh_cluster, gen, uname) -> None:
    """put(name, t) to every rank uploads to the leader, which keeps the upload as its
    value: the value it replaces is what the next upload of that size lands in. The
    follower receives the leader's broadcast into the value it replaced before."""
    local, client = fresh_cluster(2, "--metrics-port", "0")
    addresses = wait_until(
        lambda: metrics_endpoints(local.log_path, 2), 30, "the workers' metrics endpoints"
    )["worker"]
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    leader = next(p for p in ports if value(scrape(p), "collectives_worker_rank") == 0)
    (follower,) = [p for p in ports if p != leader]
    before = _reused(leader)
    results_before = _reused(follower, "result")
    name = uname("everywhere")
    for _ in range(ROUNDS):  # no get in between: a GET in flight would pin a value
        t = torch.randn(8 * MiB // 4, generator=gen)  # 8 MiB: a replicated put
        client.put(name, t)
    for rank in range(client.world_size):
        assert torch.equal(client.get(name, rank=rank), t), rank
    # Uploads 1 and 2 found nothing kept; each later one the upload two before it.
    assert _reused(leader) - before == ROUNDS - 2
    # Likewise the follower's broadcast results, each into the result two before it.
    assert _reused(follower, "result") - results_before == ROUNDS - 2
