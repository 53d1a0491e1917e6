"""Puts and op results land in the memory of a value just replaced
(``worker/replaced_memory.py``).

Over the bulk port and over the gRPC stream (``--no-bulk``): two names of the
same size are put in turn with fresh random values, so each put after the
third is received into memory that last held the *other* name's previous
value. Every stored value must read back exactly as last put, and the worker's
``collectives_put_buffers_reused_total`` must count each reuse. A replicated put
reuses memory on every rank: the leader's upload lands where its previous
upload was, a follower's broadcast result where its previous result was
(``collectives_result_buffers_reused_total``), and a publish's uploads on the
leader where the weights the publish before replaced were. Puts, reads and
in-place ops of one size running together share the one pool, and no read is
ever torn (a pool that kept memory still being sent fails it: checked by
breaking it).
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import metrics_endpoints, wait_until
from test_metrics import scrape, value

import collectives

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


def test_puts_reads_and_in_place_ops_of_one_size_share_the_pool_and_every_value_holds(
    fresh_cluster, gen, uname
) -> None:
    """One pool serves the puts (RPC threads) and the op results (the generation's
    thread) at once. Three clients run together on 2 MiB tensors: one puts and reads
    back a name, one runs in-place all_reduces on another, and one reads that name
    while the ops replace it. A read must be one of the values the chain of sums
    went through, whole: memory still being sent must never be reused."""
    local, client = fresh_cluster(2, "--metrics-port", "0")
    ports = [
        int(a.rsplit(":", 1)[1])
        for a in wait_until(
            lambda: metrics_endpoints(local.log_path, 2), 30, "the workers' metrics endpoints"
        )["worker"]
    ]
    before = {p: _reused(p) + _reused(p, "result") for p in ports}
    numel, rounds = 2 * MiB // 4, 32
    put_name, op_name = uname("put"), uname("reduced")
    parts = [torch.randn(numel, generator=gen) for _ in range(client.world_size)]
    for rank, part in enumerate(parts):
        client.put(op_name, part, rank=rank)
    # What rank 0 holds before op k (k = 0: its own part); the sums double exactly.
    total = parts[0] + parts[1]  # float32, as torch sums
    states = [parts[0]] + [total * float(2**k) for k in range(rounds)]
    puts = [torch.randn(numel, generator=gen) for _ in range(rounds)]
    errors: list[BaseException] = []
    ops_done = threading.Event()

    def putting() -> None:
        with collectives.connect(local.address, timeout=60) as own:
            for i, t in enumerate(puts):
                own.put(put_name, t, rank=i % 2)
                assert torch.equal(own.get(put_name, rank=i % 2), t), f"put {i}"

    def reading() -> None:
        with collectives.connect(local.address, timeout=60) as own:
            for i in range(4 * rounds):  # bounded; stops early once the ops are done
                got = own.get(op_name, rank=0)
                assert any(torch.equal(got, s) for s in states), f"read {i}: a torn value"
                if ops_done.is_set():
                    break

    def guarded(body):
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        return threading.Thread(target=run, name=body.__name__)

    threads = [guarded(putting), guarded(reading)]
    for t in threads:
        t.start()
    try:
        for _ in range(rounds):
            client.all_reduce(op_name)
    finally:
        ops_done.set()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads), "a client thread did not finish"
    assert not errors, errors
    for rank in range(client.world_size):
        assert torch.equal(client.get(op_name, rank=rank), states[-1]), rank
    assert all(_reused(p) + _reused(p, "result") > before[p] for p in ports)


def test_a_publish_lands_on_the_leader_in_the_weights_the_one_before_replaced(
    fresh_cluster, gen, uname
) -> None:
    """The leader adopts a publish's uploads as the new weights, so the weights they
    replace are what the next publish's uploads are received into (the leader's put
    pool counts each); every rank then serves exactly the weights published last."""
    local, client = fresh_cluster(
        2, "--metrics-port", "0", "--allow-factory", "collectives_server.model_zoo"
    )
    addresses = wait_until(
        lambda: metrics_endpoints(local.log_path, 2), 30, "the workers' metrics endpoints"
    )["worker"]
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    leader = next(p for p in ports if value(scrape(p), "collectives_worker_rank") == 0)
    name = uname("model")
    # Three 1 MiB weight matrices (512 x 512 float32) and three small biases.
    kwargs = {"in_features": 512, "hidden": 512, "out_features": 512, "depth": 2, "seed": 3}
    client.load_model(name, factory="collectives_server.model_zoo:mlp", kwargs=kwargs)
    like = client.state_dict(name, rank=0)
    large = sum(1 for t in like.values() if t.numel() * t.element_size() >= MiB)
    assert large == 3
    before = _reused(leader)
    for _ in range(ROUNDS):
        weights = {k: torch.randn(v.shape, generator=gen) for k, v in like.items()}
        client.publish(name, weights)
    for rank in range(client.world_size):
        served = client.state_dict(name, rank=rank)
        assert all(torch.equal(served[k], weights[k]) for k in weights), rank
    # Publish 1 replaced the factory's weights, which publish 2's uploads landed in,
    # and so on: every publish after the first, each of its large weights.
    assert _reused(leader) - before == large * (ROUNDS - 1)
