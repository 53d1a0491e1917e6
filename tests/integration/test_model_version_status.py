"""A model's version in the ops views of a live cluster: after ``publish``, the
version it returned shows in ``collectives status --json`` and the table (both
from the status the workers' heartbeats carry) and in each worker's
``collectives_model_version{model}`` metric."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

COLLECTIVES_CLI = str(Path(sys.executable).with_name("collectives"))
ZOO = ("--allow-factory", "collectives_server.model_zoo")
MLP = {"in_features": 6, "hidden": 8, "out_features": 3, "seed": 5}
WORKERS = 2
_WORKER_ENDPOINT = re.compile(r"worker metrics at http://(\S+)/metrics")


def _worker_endpoints(log_path: Path) -> list[str] | None:
    """host:port of every worker's /metrics, once the cluster's log names them all."""
    found = _WORKER_ENDPOINT.findall(log_path.read_text(errors="replace"))
    return found if len(found) == WORKERS else None


def _model_versions(address: str) -> dict[str, float]:
    """{model: value} of collectives_model_version on one worker's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        s.labels["model"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "collectives_model_version"
    }


def _status(address: str, *flags: str) -> str:
    result = subprocess.run(
        [COLLECTIVES_CLI, "status", "--coordinator", address, *flags],
        capture_output=True, text=True, timeout=60, check=False,
        env=dict(os.environ, COLUMNS="200"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.timeout(180)
def test_a_published_version_shows_in_status_and_metrics(fresh_cluster, gen) -> None:
    local, cluster = fresh_cluster(WORKERS, "--metrics-port", "0", *ZOO)
    endpoints = wait_until(
        lambda: _worker_endpoints(local.log_path), 30, "the workers' metrics endpoints in the log"
    )
    name = "ops-view/mlp"
    assert (
        cluster.load_model(name, factory="collectives_server.model_zoo:mlp", kwargs=MLP).version
        == 1
    )
    like = cluster.state_dict(name)
    for _ in range(2):
        state = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in like.items()}
        version = cluster.publish(name, state)
    assert version == 3

    # The coordinator has it once a heartbeat after the publish carried each status.
    def reported() -> bool:
        workers = cluster.workers()
        return len(workers) == WORKERS and all(
            w.model_versions.get(name) == version for w in workers
        )

    wait_until(reported, 20, f"every worker's heartbeat status to report {name} v{version}")

    data = json.loads(_status(local.address, "--json"))
    assert len(data["workers"]) == WORKERS, data
    for w in data["workers"]:
        assert w["models"] == [name], w
        assert w["model_versions"] == {name: version}, w
        assert w["model_versions_omitted"] == 0, w

    table = _status(local.address)
    addresses = {w["address"] for w in data["workers"]}
    rows = [
        line for line in table.splitlines() if line.split()[2:3] and line.split()[2] in addresses
    ]
    assert len(rows) == WORKERS, table
    assert all(f"{name}@v{version}" in row and "*" not in row for row in rows), table
    assert "lagging models" not in table, table

    # Each worker's /metrics computes it at scrape time: the version is there at once.
    for address in endpoints:
        assert _model_versions(address) == {name: float(version)}, address
    cluster.unload_model(name)
    for address in endpoints:
        assert _model_versions(address) == {}, address
