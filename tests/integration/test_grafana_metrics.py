"""Every metric and label the Grafana dashboard (docker/grafana/dashboards) queries
is exported by the daemons.

A local cluster of 2 workers serves /metrics (``--metrics-port 0``: free ports,
read from the log); after a small workload — so that labelled series such as ops
by kind and status exist — every endpoint is scraped and parsed with
``prometheus_client.parser``. Names are compared as *sample* names
(``collectives_ops_total``, ``collectives_op_latency_seconds_bucket``), the names
Prometheus stores and PromQL queries.
"""

from __future__ import annotations

import urllib.request

import pytest
import torch
from grafana_queries import IMPLICIT_LABELS, dashboard_queries
from helpers import metrics_endpoints, wait_until
from prometheus_client.parser import text_string_to_metric_families

import collectives


def _scrape(address: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from one /metrics endpoint."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


@pytest.mark.timeout(180)
def test_every_dashboard_metric_is_exported(fresh_cluster, gen, uname) -> None:
    # With a dashboard, as docker/compose.yaml runs it: its connection gauges are queried.
    local, cluster = fresh_cluster(2, "--metrics-port", "0", "--dashboard-port", "0")
    endpoints = wait_until(
        lambda: metrics_endpoints(local.log_path, 2), 30, "metrics endpoints in the cluster's log"
    )
    # A workload that touches every labelled series: data moved both ways, a
    # collective, a failed op, and a membership history.
    name = uname("m")
    cluster.put(name, torch.randn(256, generator=gen))
    cluster.all_reduce(name, op="sum")
    cluster.get(name, rank=1)
    with pytest.raises(collectives.NotFound):
        cluster.get(uname("missing"), rank=0)
    cluster.barrier()

    def exported() -> dict[str, set[str]]:
        samples: dict[str, set[str]] = {}
        for address in [*endpoints["coordinator"], *endpoints["worker"]]:
            for sample, labels in _scrape(address).items():
                samples.setdefault(sample, set()).update(labels)
        return samples

    queries = dashboard_queries()
    wanted = set().union(*(q.metrics for q in queries))

    # Heartbeats carry worker status to the coordinator; give the counters a moment.
    samples = wait_until(
        lambda: (s := exported()) and wanted <= set(s) and s,
        15,
        "every dashboard metric on the /metrics endpoints",
    )
    missing = sorted(wanted - set(samples))
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
    for query in queries:
        have = set().union(*(samples[m] for m in query.metrics)) | IMPLICIT_LABELS
        assert query.labels <= have, (
            f"{query.where}: labels {sorted(query.labels - have)} are on none of "
            f"{sorted(query.metrics)} (exported labels: {sorted(have - IMPLICIT_LABELS)})"
        )
