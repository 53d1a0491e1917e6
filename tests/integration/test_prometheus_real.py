"""Every query of the Grafana dashboard returns data from a real Prometheus.

test_grafana_metrics compares names with what /metrics exports; this test runs the
monitoring pipeline of docker/ for real, without Docker: a local cluster of 2
workers serving /metrics on free loopback ports, Debian's ``prometheus`` scraping
them with the project's prometheus.yml (targets replaced, intervals shortened;
tests/prometheus_server.py), traffic between scrapes (collectives checked against
torch, put/get, a data-parallel backward with bucketed gradients), then every
PromQL expression of the dashboard through ``/api/v1/query`` with its variables
substituted as Grafana would — once with "All" selected and once with one real
worker — and every one must return series. Template variables (``label_values``)
go through ``/api/v1/label/<label>/values``.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
import yaml
from grafana_queries import all_values, dashboard_queries, label_values, render
from helpers import (
    assert_tensor,
    get_each,
    metrics_endpoints,
    put_each,
    reduce_oracle,
    wait_until,
)
from prometheus_server import PROJECT_CONFIG, Prometheus, local_config, prometheus_binary
from torch import nn

from collectives_server import model_zoo

log = logging.getLogger(__name__)

SCRAPE_INTERVAL = "1s"
# $__rate_interval: Grafana makes it at least 4 scrape intervals; 15 s also holds
# the two scrapes after the traffic when a loaded machine delays one.
RATE_INTERVAL = "15s"
MODEL_FACTORY = "collectives_server.model_zoo:mlp"
MODEL_KWARGS = {"in_features": 6, "hidden": 8, "out_features": 3, "seed": 7}
STARTUP_S = 30.0


def _targets(prometheus: Prometheus) -> list[dict]:
    return prometheus.api("targets", state="active")["activeTargets"]


def _all_up(prometheus: Prometheus, expected: set[tuple[str, str, str]]) -> bool:
    """Every target of the config scraped and up (raises with the details otherwise)."""
    targets = _targets(prometheus)
    seen = {
        (t["labels"]["job"], t["labels"].get("role", ""), t["labels"]["instance"]) for t in targets
    }
    assert seen == expected, f"targets {sorted(seen)} != the config's {sorted(expected)}"
    down = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets if t["health"] != "up"]
    assert not down, f"targets not up: {down}"
    return True


def _scraped_since(prometheus: Prometheus, since: float) -> bool:
    """Every target's last scrape started after ``since`` (wall-clock seconds)."""
    starts = [datetime.fromisoformat(t["lastScrape"]).timestamp() for t in _targets(prometheus)]
    return bool(starts) and min(starts) > since


def _expected_targets(config: dict) -> set[tuple[str, str, str]]:
    return {
        (job["job_name"], static.get("labels", {}).get("role", ""), target)
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }


def _traffic(cluster, gen: torch.Generator, uname, model: str, reference: nn.Module) -> None:
    """An all_reduce and a broadcast checked against torch, puts and gets, and a
    data-parallel backward whose bucketed gradient all-reduce matches local autograd."""
    world = cluster.world_size
    name = uname("sum")
    inputs = [torch.randn(256, generator=gen) for _ in range(world)]
    put_each(cluster, name, inputs)
    cluster.all_reduce(name, op="sum")
    expected = reduce_oracle("sum", inputs)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, expected, exact=False, what=f"all_reduce on rank {rank}")
    name = uname("bcast")
    source = torch.randn(4, 5, generator=gen)
    cluster.put(name, source, rank=1)
    cluster.broadcast(name, src=1)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, source, what=f"broadcast on rank {rank}")

    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    cluster.zero_grad(model)
    F.mse_loss(cluster.data_parallel(model)(x), y).backward()
    cluster.all_reduce_gradients(model, op="sum")
    reference.zero_grad()
    F.mse_loss(reference(x), y).backward()
    for rank in range(world):
        grads = cluster.gradients(model, rank=rank)
        for key, param in reference.named_parameters():
            torch.testing.assert_close(grads[key], param.grad, rtol=1e-4, atol=1e-6)


def _regex_value(value: str) -> str:
    """One selected value of a multi-value variable in a ``=~`` matcher, escaped as
    Grafana's Prometheus data source does (a backslash doubled inside the string)."""
    return re.sub(r"[\\$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


@pytest.mark.timeout(120)
def test_every_dashboard_query_returns_series(fresh_cluster, gen, uname, tmp_path) -> None:
    binary = prometheus_binary()  # skips (fails with CI=true) before starting anything
    local, cluster = fresh_cluster(
        2,
        "--metrics-port",
        "0",
        "--dashboard-port",  # as docker/compose.yaml runs it: its gauges are queried
        "0",
        "--allow-factory",
        MODEL_FACTORY.split(":")[0],
    )
    endpoints = wait_until(
        lambda: metrics_endpoints(local.log_path, 2), STARTUP_S, "metrics endpoints in the log"
    )
    config = local_config(yaml.safe_load(PROJECT_CONFIG.read_text()), endpoints, SCRAPE_INTERVAL)
    model = "mlp"  # the cluster is this test's own
    cluster.load_model(model, factory=MODEL_FACTORY, kwargs=MODEL_KWARGS)
    reference = model_zoo.mlp(**MODEL_KWARGS)

    with Prometheus(binary, config, tmp_path / "prometheus") as prometheus:
        expected = _expected_targets(config)
        wait_until(lambda: _all_up(prometheus, expected), STARTUP_S, "every target up")
        # Two rounds, each followed by a scrape of every target: the counters move
        # between two scrapes that lie inside the rate window.
        for _ in range(2):
            _traffic(cluster, gen, uname, model, reference)
            done = time.time()
            wait_until(
                lambda done=done: _scraped_since(prometheus, done),
                STARTUP_S,
                "a scrape of every target after the traffic",
            )

        queries = dashboard_queries()
        choices: dict[str, list[str]] = {}
        rows: list[tuple[str, int, int | None]] = []
        for query in (q for q in queries if q.variable):
            parsed = label_values(query.expr)
            assert parsed, f"{query.where}: only label_values() variables are supported"
            metric, label = parsed
            choices[query.variable] = prometheus.api(f"label/{label}/values", **{"match[]": metric})
            rows.append((query.expr, len(choices[query.variable]), None))
        assert set(choices.get("instance", [])) == set(endpoints["worker"]), (
            "$instance should offer exactly the workers"
        )
        every = {"__rate_interval": RATE_INTERVAL, **all_values()}
        one = {**every, **{name: _regex_value(values[0]) for name, values in choices.items()}}
        for query in (q for q in queries if not q.variable):
            rows.append(
                (
                    query.expr,
                    len(prometheus.query(render(query.expr, every))),
                    len(prometheus.query(render(query.expr, one))),
                )
            )
        ops_per_s = prometheus.query(f"sum(rate(collectives_ops_total[{RATE_INTERVAL}]))")

    picked = ", ".join(f"${n}={v[0]}" for n, v in choices.items())
    table = "\n".join(
        [f"{'All':>4} {'one':>4}  expression (one: {picked})"]
        + [f"{a:>4} {'-' if b is None else b:>4}  {expr}" for expr, a, b in rows]
    )
    log.info(f"series per dashboard query, from a real Prometheus:\n{table}")
    empty = [expr for expr, a, b in rows if a == 0 or b == 0]
    assert not empty, f"dashboard queries without series:\n{empty}\n{table}"
    assert ops_per_s and float(ops_per_s[0]["value"][1]) > 0, f"no ops seen: {ops_per_s}"
