"""Fused small ops (``worker/fusion.py``): several queued small ops announced and
exchanged together, each keeping its own result, error and order.

Eight clients (each its own connection, so their ops queue side by side on the
leader) issue small collectives on their own names with fresh random operands;
every result is compared with what torch computes locally, the workers'
metrics show that ops did run fused, and ops that share a name are never fused
(each reads what the one before it committed).
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import assert_tensor, connect_ready, make_input, put_each, reduce_oracle
from launcher import LocalCluster, free_port_block
from test_metrics import scrape, value

import collectives

WORKERS = 2
CLIENTS = 8
OPS_PER_CLIENT = 30
DEADLINE_S = 120.0


def _client_loop(address: str, index: int, errors: list[BaseException]) -> None:
    gen = torch.Generator().manual_seed(1000 + index)
    name = f"fusion/c{index}"
    try:
        with collectives.connect(address, timeout=60) as cluster:
            inputs = [make_input(torch.int64, (3, 2), gen) for _ in range(WORKERS)]
            put_each(cluster, name, inputs)
            for i in range(OPS_PER_CLIENT):
                if i % 5 == 4:  # fresh operands on one rank now and then
                    rank = i % WORKERS
                    inputs[rank] = make_input(torch.int64, (3, 2), gen)
                    cluster.put(name, inputs[rank], rank=rank)
                kind = i % 3
                what = f"client {index} op {i}"
                if kind == 0:
                    out = f"{name}/sum"
                    cluster.all_reduce(name, op="sum", out=out, timeout=60)
                    got = cluster.get(out, rank=i % WORKERS)
                    assert_tensor(got, reduce_oracle("sum", inputs), what=f"{what} all_reduce")
                elif kind == 1:
                    root = i % WORKERS
                    got = cluster.reduce(name, dst=root, op="max", out=f"{name}/max", timeout=60)
                    assert_tensor(got, reduce_oracle("max", inputs), what=f"{what} reduce")
                else:
                    parts = cluster.all_gather(name, out=f"{name}/parts", timeout=60)
                    for rank, part in enumerate(parts):
                        assert_tensor(part, inputs[rank], what=f"{what} all_gather part {rank}")
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


def _run_clients(target, count: int, *args) -> list[BaseException]:
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=target, args=(*args, i, errors), daemon=True) for i in range(count)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), f"clients still running after {DEADLINE_S} s"
    return errors


@pytest.fixture(scope="module")
def metrics_cluster(tmp_path_factory):
    """A 2-worker cluster with metrics on P (coordinator), P+1, P+2 (workers)."""
    base = free_port_block(WORKERS + 1)
    log = tmp_path_factory.mktemp("fusion") / "cluster.log"
    local = LocalCluster(WORKERS, ["--metrics-port", str(base)], log)
    address = local.start()
    client = connect_ready(address, WORKERS)
    try:
        yield address, base, client
    finally:
        client.close()
        local.stop()


def test_concurrent_small_ops_fuse_and_each_result_is_right(metrics_cluster):
    address, base, _ = metrics_cluster
    before = [value(scrape(base + 1 + r), "collectives_fused_ops_total") for r in range(WORKERS)]
    errors = _run_clients(_client_loop, CLIENTS, address)
    assert not errors, f"{len(errors)} client(s) failed; first: {errors[0]!r}"
    fused = [value(scrape(base + 1 + r), "collectives_fused_ops_total") for r in range(WORKERS)]
    runs = value(scrape(base + 1), "collectives_fused_runs_total")
    # Every rank runs every op, fused or not, the same way.
    assert fused[0] - before[0] == fused[1] - before[1]
    assert fused[0] > before[0], "8 clients' small ops never ran fused"
    assert runs >= 1 and fused[0] >= 2 * runs


def _same_name_loop(address: str, rounds: int, index: int, errors: list[BaseException]) -> None:
    try:
        with collectives.connect(address, timeout=60) as cluster:
            for _ in range(rounds):
                cluster.all_reduce("fusion/shared", op="sum", timeout=60)
    except BaseException as exc:
        errors.append(exc)


def test_ops_on_one_name_are_never_fused(metrics_cluster):
    """Four clients each all_reduce one shared name in place, three times: every op
    must read what the previous one committed, so the result is 2**12 times the
    first sum (an op fused with another on the same name would read a stale value)."""
    address, _, cluster = metrics_cluster
    gen = torch.Generator().manual_seed(7)
    inputs = [make_input(torch.int64, (4,), gen) for _ in range(WORKERS)]
    put_each(cluster, "fusion/shared", inputs)
    clients, rounds = 4, 3
    errors = _run_clients(_same_name_loop, clients, address, rounds)
    assert not errors, f"{len(errors)} client(s) failed; first: {errors[0]!r}"
    expected = reduce_oracle("sum", inputs) * 2 ** (clients * rounds - 1)
    for rank in range(WORKERS):
        assert_tensor(cluster.get("fusion/shared", rank=rank), expected, what=f"rank {rank}")
