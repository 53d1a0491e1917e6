"""docker/ without a Docker engine: compose file, Dockerfile, Prometheus and Grafana config.

``docker compose config`` validates the compose file where the docker client has
the compose plugin; elsewhere (our machines) the file is parsed with PyYAML. Either
way the daemons' command lines are parsed with the real ``collectives-server``
argument parser, so a flag that does not exist fails here, not in a container.
Whether the code exports every metric the Grafana dashboard queries is checked
against live /metrics endpoints in tests/integration/test_grafana_metrics.py, and
whether a real Prometheus returns data for every query in
tests/integration/test_prometheus_real.py (whose config rewrite is tested here).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from daemon_cli import parse_coordinator, parse_worker
from grafana_queries import DASHBOARD, all_values, dashboard_queries, parse_expr, render
from prometheus_server import PROJECT_CONFIG, local_config

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"

# The metric names the dashboard is built on (the contract with the daemons; see
# docs/design.md). The live test checks that the code exports each of them.
CONTRACT = {
    # coordinator
    "collectives_generation",
    "collectives_world_size",
    "collectives_cluster_formed",
    "collectives_workers",
    "collectives_membership_changes_total",
    "collectives_heartbeats_received_total",
    "collectives_worker_heartbeat_age_seconds",
    "collectives_coordinator_leader",
    # workers
    "collectives_ops_total",
    "collectives_op_latency_seconds_bucket",
    "collectives_op_phase_seconds_bucket",
    "collectives_op_straggler_total",
    "collectives_bytes_total",
    "collectives_queue_depth",
    "collectives_tensors_held",
    "collectives_tensors_held_bytes",
    "collectives_replaced_memory_bytes",
    "collectives_device_memory_used_bytes",
    "collectives_device_memory_total_bytes",
    "collectives_worker_generation",
    "collectives_worker_rank",
    "collectives_heartbeats_sent_total",
    "collectives_heartbeat_failures_total",
    "collectives_models_loaded",
    "collectives_data_collectives_total",
    "collectives_gradient_buckets_total",
    "collectives_build_info",
    "collectives_collective_bytes_total",
    "collectives_clients_connected",
    "collectives_error_groups",
    # connections held and refused at a cap (worker; coordinator with a dashboard)
    "collectives_data_streams_active",
    "collectives_bulk_connections_open",
    "collectives_bulk_connections_refused_total",
    "collectives_dashboard_connections_open",
    "collectives_dashboard_connections_refused_total",
}


def _compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        result = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


@pytest.fixture(scope="module")
def compose() -> dict:
    """The compose model: from ``docker compose config`` if possible, else PyYAML."""
    if _compose_plugin():
        result = subprocess.run(
            ["docker", "compose", "-f", str(COMPOSE), "config", "--format", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, f"docker compose config failed:\n{result.stderr}"
        return json.loads(result.stdout)
    # PyYAML resolves the << merge keys; ${VAR:-default} stays as written.
    return yaml.safe_load(COMPOSE.read_text())


def _services(compose: dict, prefix: str) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if name.startswith(prefix)}


def _command(service: dict) -> list[str]:
    command = service["command"]
    return command.split() if isinstance(command, str) else [str(c) for c in command]


def _published(service: dict) -> set[int]:
    """Container ports the service publishes ("127.0.0.1:8080:8080" or the long form)."""
    ports = set()
    for port in service.get("ports", []):
        if isinstance(port, dict):
            ports.add(int(port["target"]))
        else:
            ports.add(int(str(port).rsplit(":", 1)[1].split("/")[0]))
    return ports


def _coordinator(compose: dict):
    return parse_coordinator(_command(compose["services"]["coordinator"]))


def _workers(compose: dict) -> dict:
    workers = {}
    for name, service in _services(compose, "worker").items():
        argv = _command(service)
        assert argv[0] == "worker", f"{name} runs {argv[0]!r}"
        workers[name] = parse_worker(argv)
    return workers


def _expand(value: str) -> str:
    """``${VAR:-default}`` → default (what compose uses when VAR is unset)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", value)


# ---------------------------------------------------------------- compose.yaml


def test_compose_services(compose: dict) -> None:
    services = set(compose["services"])
    assert {"coordinator", "worker-1", "worker-2", "prometheus", "grafana"} <= services


def test_coordinator_command_parses_and_matches_the_published_ports(compose: dict) -> None:
    config = _coordinator(compose)
    assert config.host == "0.0.0.0" and config.advertise_host == "coordinator"
    assert (config.min_workers, config.max_workers) == (2, 2)
    assert len(_workers(compose)) == config.max_workers, "--world-size != worker services"
    assert (config.metrics_host, config.dashboard_host) == ("0.0.0.0", "0.0.0.0")
    published = _published(compose["services"]["coordinator"])
    assert {config.port, config.dashboard_port, config.metrics_port} <= published
    assert config.port != 0, "fixed ports in containers"


def test_workers_reach_the_coordinator_and_advertise_their_service_name(compose: dict) -> None:
    coordinator = _coordinator(compose)
    for name, config in _workers(compose).items():
        assert config.coordinator == f"coordinator:{coordinator.port}", name
        # A worker bound to 0.0.0.0 advertises gethostname():port; the hostname must
        # be the service name, which the compose network resolves.
        assert config.host == "0.0.0.0", name
        assert compose["services"][name].get("hostname") == name, name
        assert config.port != 0 and config.metrics_port is not None, name
        assert config.metrics_host == "0.0.0.0", name


def test_builds_and_mounts_refer_to_files_that_exist(compose: dict) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = (DOCKER / _expand(build["context"])).resolve()
            assert context == ROOT, f"{name}: build context {context}"
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
            args = build.get("args", {})
            assert _expand(args["BASE_IMAGE"]) == "python:3.11-slim"
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith((".", "/")):
                path = (DOCKER / source).resolve()
                assert path.exists(), f"{name}: mounts {source}, which does not exist"


def test_dockerfile() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert "-c constraints.txt" in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    assert re.search(r'^ENTRYPOINT \["collectives-server"\]$', text, re.M)
    for source in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    ignored = (ROOT / ".dockerignore").read_text().split()
    for needed in ("!constraints.txt", "!client", "!server"):
        assert needed in ignored, f".dockerignore must let {needed[1:]} into the context"


# ------------------------------------------------------------- Prometheus, Grafana


def test_prometheus_scrapes_every_daemon_on_its_metrics_port(compose: dict) -> None:
    config = yaml.safe_load((DOCKER / "prometheus/prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }
    expected = {f"coordinator:{_coordinator(compose).metrics_port}"}
    expected |= {f"{name}:{c.metrics_port}" for name, c in _workers(compose).items()}
    assert targets == expected
    mounts = compose["services"]["prometheus"]["volumes"]
    assert any("prometheus.yml" in str(m) for m in mounts)


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard(compose: dict) -> None:
    provisioning = DOCKER / "grafana/provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards/dashboards.yml").read_text())[
        "providers"
    ]
    mounts = [str(m) for m in compose["services"]["grafana"]["volumes"]]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in [panel, *panel["targets"]]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]


# ----------------------------------------------------------- the dashboard queries


@pytest.mark.parametrize(
    ("expr", "metrics", "labels"),
    [
        ("max(collectives_generation)", {"collectives_generation"}, set()),
        (
            'sum by (kind, status) (rate(collectives_ops_total{instance=~"$instance"}[5m]))',
            {"collectives_ops_total"},
            {"kind", "status", "instance"},
        ),
        (
            "histogram_quantile(0.99, sum by (kind, le) "
            "(rate(collectives_op_latency_seconds_bucket[$__rate_interval])))",
            {"collectives_op_latency_seconds_bucket"},
            {"kind", "le"},
        ),
        (
            'a_total{x="b{c}"} / on (y) group_left (z) b_bytes offset 5m',
            {"a_total", "b_bytes"},
            {"x", "y", "z"},
        ),
        (
            "label_values(collectives_worker_rank, instance)",
            {"collectives_worker_rank"},
            {"instance"},
        ),
    ],
)
def test_parse_expr(expr: str, metrics: set[str], labels: set[str]) -> None:
    assert parse_expr(expr) == (metrics, labels)


def test_dashboard_queries_exactly_the_contract_metrics() -> None:
    used = set().union(*(q.metrics for q in dashboard_queries()))
    assert used - CONTRACT == set(), "the dashboard queries metrics outside the contract"
    assert CONTRACT - used == set(), "contract metrics that no panel shows"
    for query in dashboard_queries():
        assert query.metrics, f"{query.where}: no metric in {query.expr!r}"


def test_workers_accept_model_uploads(compose: dict) -> None:
    """The examples ship models as archives; the compose workers have no token, so
    uploads (off by default without one) are enabled explicitly."""
    for name, config in _workers(compose).items():
        assert config.model_upload.allow, f"{name}: add --allow-model-upload"
        assert config.model_upload.load_sandbox, f"{name}: the load sandbox should stay on"


def test_render_substitutes_grafana_variables() -> None:
    values = {"instance": ".*", "__rate_interval": "15s"}
    expr = 'rate(x{instance=~"$instance"}[$__rate_interval]) + y{i=~"${instance}"}[[instance]]'
    assert render(expr, values) == 'rate(x{instance=~".*"}[15s]) + y{i=~".*"}.*'
    with pytest.raises(KeyError, match="nope"):
        render("x{a=~'$nope'}", values)
    with pytest.raises(ValueError, match="format"):
        render("${instance:csv}", values)
    for query in dashboard_queries():  # every variable of the dashboard has a value
        if not query.variable:
            assert "$" not in render(query.expr, {**values, **all_values()}), query.where


def test_local_config_changes_only_targets_and_intervals() -> None:
    project = yaml.safe_load(PROJECT_CONFIG.read_text())
    live = {"coordinator": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    config = local_config(project, live, "1s")
    assert config["global"]["scrape_interval"] == config["global"]["evaluation_interval"] == "1s"
    targets = [
        t for job in config["scrape_configs"] for st in job["static_configs"] for t in st["targets"]
    ]
    assert sorted(targets) == sorted(live["coordinator"] + live["worker"])
    for job, ours in zip(project["scrape_configs"], config["scrape_configs"], strict=True):
        assert ours["job_name"] == job["job_name"]
        for static, mine in zip(job["static_configs"], ours["static_configs"], strict=True):
            assert mine["labels"] == static["labels"]
            assert len(mine["targets"]) == len(static["targets"])
            assert set(mine["targets"]) <= set(live[static["labels"]["role"]])
    assert project["global"]["scrape_interval"] != "1s", "the project file was modified"
    # Anything else is kept as written.
    project["global"]["external_labels"] = {"stack": "compose"}
    project["scrape_configs"][0] |= {"metrics_path": "/m", "scrape_interval": "9s"}
    project["rule_files"] = ["rules.yml"]
    config = local_config(project, live, "1s")
    assert config["global"]["external_labels"] == {"stack": "compose"}
    assert config["scrape_configs"][0]["metrics_path"] == "/m"
    assert config["scrape_configs"][0]["scrape_interval"] == "1s"
    assert config["rule_files"] == ["rules.yml"]
    with pytest.raises(ValueError, match="no job"):
        local_config(project, {**live, "worker": [*live["worker"], "127.0.0.1:4"]}, "1s")
    with pytest.raises(ValueError, match="only 1 live"):
        local_config(project, {**live, "worker": live["worker"][:1]}, "1s")
