"""Dynamic batching on real workers: concurrent no-grad forwards of one model merged.

Every caller's output must equal its own rows through the model at the version
the SDK reports (shard by shard, as the SDK splits), however its forwards were
merged with other clients' and whatever publishes ran meanwhile; a caller with a
malformed input fails alone; forwards with autograd, or of a model in training
mode, are never merged, which the workers' Prometheus metrics show.
"""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
import torch
from helpers import connect_ready, wait_until
from launcher import free_port_block
from prometheus_client.parser import text_string_to_metric_families

import collectives
from collectives.wire.pytree import scatter_kwargs
from collectives_server import model_zoo

ZOO = "collectives_server.model_zoo"
KWARGS = {"in_features": 12, "hidden": 32, "out_features": 5, "depth": 2, "seed": 3}
WORKERS = 2
CLIENTS = 8
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def batching_cluster(local_cluster):
    """(address, metrics port of worker 0) of a 2-worker cluster whose workers batch
    factory-built models by default (``--factory-batching 64:5``)."""
    base = free_port_block(WORKERS + 1)
    address = local_cluster(
        WORKERS,
        "--allow-factory",
        ZOO,
        "--factory-batching",
        "64:5",
        "--metrics-port",
        str(base),
    )
    return address, base + 1


def _batch_metrics(first_port: int, model: str) -> tuple[float, float, float]:
    """(forwards the batchers ran, rows-histogram count, rows-histogram sum), summed over
    the workers' /metrics."""
    batches = count = total = 0.0
    for port in range(first_port, first_port + WORKERS):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("model") != model:
                    continue
                if s.name == "collectives_forward_batches_total":
                    batches += s.value
                elif s.name == "collectives_forward_batch_rows_count":
                    count += s.value
                elif s.name == "collectives_forward_batch_rows_sum":
                    total += s.value
    return batches, count, total


def _expected(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    local = model_zoo.mlp(**KWARGS)
    local.load_state_dict(weights)
    parts, _ = scatter_kwargs((x,), {}, WORKERS)
    with torch.no_grad():
        return torch.cat([local(*p) for p in parts])


def _run_clients(address: str, name: str, work, clients: int = CLIENTS) -> list:
    """Runs ``work(i, dp)`` in ``clients`` threads, each with its own client, started
    together; their results, or the first error."""
    results: list = [None] * clients
    errors: list[BaseException] = []
    start = threading.Barrier(clients)

    def one(i: int) -> None:
        try:
            with connect_ready(address, WORKERS) as client:
                dp = client.data_parallel(name)
                start.wait(timeout=60)
                results[i] = work(i, dp)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    return results


def test_merged_outputs_equal_each_callers_own_under_publishes(batching_cluster, gen, uname):
    address, metrics_port = batching_cluster
    name = uname("merged")
    with connect_ready(address, WORKERS) as cluster:
        info = cluster.load_model(
            name,
            factory=f"{ZOO}:mlp",
            kwargs=KWARGS,
            batching=collectives.Batching(max_rows=256, max_delay_ms=20.0),
        )
        assert info.batching == collectives.Batching(256, 20.0)
        cluster.data_parallel(name).eval()
        weights = {1: model_zoo.mlp(**KWARGS).state_dict()}
        calls = 6
        rows = [int(r) for r in torch.randint(1, 101, (CLIENTS * calls,), generator=gen)]
        rows[0] = 1  # row counts 1 to 100
        rows[1] = 100
        seeds = [int(s) for s in torch.randint(0, 1 << 30, (CLIENTS,), generator=gen)]
        published, first_done = threading.Event(), threading.Event()

        def infer(i: int, dp) -> list:
            local_gen = torch.Generator().manual_seed(seeds[i])
            seen = []
            for c in range(calls):
                x = torch.randn(rows[i * calls + c], KWARGS["in_features"], generator=local_gen)
                if i == CLIENTS - 1 and c % 2 == 1:  # the malformed caller, among the others
                    bad = torch.randn(rows[i * calls + c], KWARGS["in_features"] + 1)
                    with torch.no_grad(), pytest.raises(collectives.InvalidArgument) as caught:
                        dp(bad)
                    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
                    continue
                with torch.no_grad():
                    out = dp(x)
                seen.append((x, out, dp.last_version))
                first_done.set()
                if c == calls // 2:
                    published.wait(timeout=120)  # the second half runs after a publish
            return seen

        def publish() -> None:
            first_done.wait(timeout=120)
            for _ in range(3):
                state = {k: torch.randn(v.shape, generator=gen) for k, v in weights[1].items()}
                weights[cluster.publish(name, state)] = state
            published.set()

        publisher = threading.Thread(target=publish)
        publisher.start()
        try:
            seen = _run_clients(address, name, infer)
        finally:
            publisher.join(timeout=120)
        assert published.is_set()
        versions = set()
        for per_client in seen:
            for x, out, version in per_client:
                assert version in weights, version
                versions.add(version)
                torch.testing.assert_close(
                    out, _expected(weights[version], x), atol=1e-5, rtol=1e-5
                )
        assert len(versions) > 1, "no forward ran after a publish"
        batches, count, total = _batch_metrics(metrics_port, name)
        assert count == batches > 0
        shards = sum(
            min(WORKERS, len(x)) for per_client in seen for x, _, _ in per_client
        )  # the good callers' shards; a malformed one ran alone too
        assert batches < shards, "no forward was merged with another"
        assert total >= sum(len(x) for per_client in seen for x, _, _ in per_client)


def test_grad_enabled_and_training_forwards_are_never_merged(batching_cluster, gen, uname):
    address, metrics_port = batching_cluster
    name = uname("grad")
    with connect_ready(address, WORKERS) as cluster:
        info = cluster.load_model(name, factory=f"{ZOO}:mlp", kwargs=KWARGS)
        assert info.batching == collectives.Batching(64, 5.0)  # the workers' default
        dp = cluster.data_parallel(name)
        x = torch.randn(8, KWARGS["in_features"], generator=gen)

        def with_grad(i: int, dp) -> None:
            for _ in range(4):
                out = dp(x)  # autograd on (the default): never merged
                assert out.requires_grad
                del out

        dp.eval()
        _run_clients(address, name, with_grad)
        assert _batch_metrics(metrics_port, name) == (0, 0, 0)

        dp.train()

        def without_grad(i: int, dp) -> None:
            for _ in range(4):
                with torch.no_grad():
                    dp(x)

        _run_clients(address, name, without_grad)  # training mode: never merged
        assert _batch_metrics(metrics_port, name) == (0, 0, 0)

        dp.eval()
        _run_clients(address, name, without_grad)
        batches, count, total = wait_until(
            lambda: (m := _batch_metrics(metrics_port, name))[0] and m, 30, "batch metrics"
        )
        assert count == batches and total == CLIENTS * 4 * len(x)
        infos = {m.name: m for m in cluster.models()}
        assert infos[name].batched_calls > 0
        assert infos[name].batched_rows == infos[name].batched_calls * len(x) // WORKERS
