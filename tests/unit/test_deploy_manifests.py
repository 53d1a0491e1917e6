"""deploy/kubernetes without a cluster: every overlay, rendered and checked.

Each overlay is rendered by tests/kustomize_lite.py (and compared with
``kubectl kustomize`` where kubectl is installed), validated against the
Kubernetes 1.33 schemas that kubernetes-validate ships (the ServiceMonitor, a
Prometheus Operator CRD, against tests/schemas/), and then checked for what the
schemas cannot see: every daemon command line goes through the real
``collectives-server`` parser, and the ports, probes, names and selectors that
tie the objects together agree. deploy/slurm is tested in test_deploy_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml
from daemon_cli import parse_coordinator, parse_daemon, parse_worker
from kustomize_lite import Unsupported, render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy/kubernetes"
SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
# The oldest Kubernetes the manifests promise to work on (gRPC probes are GA
# since 1.27; this is the newest minor release with upstream support as written).
KUBERNETES_VERSION = "1.33"
NAMESPACE = "collectives"
OVERLAYS = ("single-cpu", "single-gpu", "ha-cpu", "ha-gpu")
COORDINATOR_REPLICAS = {"single": 1, "ha": 3}
EXPECTED = {
    ("Namespace", "collectives"),
    ("Service", "collectives-coordinator"),
    ("Service", "collectives-worker"),
    ("StatefulSet", "collectives-coordinator"),
    ("StatefulSet", "collectives-worker"),
    ("PodDisruptionBudget", "collectives-coordinator"),
    ("PodDisruptionBudget", "collectives-worker"),
    ("NetworkPolicy", "collectives"),
    ("ServiceMonitor", "collectives"),
}
# The container ports the NetworkPolicy opens to any client; the others (the
# rendezvous store) only to the collectives pods.
PUBLIC_PORTS = {"grpc", "bulk", "dashboard", "metrics"}
SAMPLE_TOKEN = "k8s-test-token"


@dataclass(frozen=True)
class Overlay:
    name: str
    resources: list[dict[str, Any]]

    def get(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [
            r for r in self.resources if r["kind"] == kind and name in (None, r["metadata"]["name"])
        ]
        assert len(found) == 1, f"{self.name}: {len(found)} {kind} {name or ''}"
        return found[0]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.resources if r["kind"] == kind]

    def statefulset(self, component: str) -> dict[str, Any]:
        return self.get("StatefulSet", f"collectives-{component}")


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> Overlay:
    return Overlay(request.param, render(KUBERNETES / "overlays" / request.param))


def _pod_labels(statefulset: dict) -> dict[str, str]:
    return statefulset["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector {selector} not implemented here"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _container(statefulset: dict) -> dict:
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return container


def _container_ports(statefulset: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in _container(statefulset)["ports"]}


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in args and env values (``$$`` escapes)."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, text)


def daemon_argv(statefulset: dict, tmp_path: Path, ordinal: int = 0) -> list[str]:
    """The arguments after the entrypoint, as pod ORDINAL's container gets them.

    Secret volumes are laid out under ``tmp_path`` with a sample token in each
    item, and the paths in the arguments point there, so the daemons' configs
    read real files.
    """
    container = _container(statefulset)
    assert "command" not in container, "the image's entrypoint (collectives-server) must run"
    fields = {
        "metadata.name": f"{statefulset['metadata']['name']}-{ordinal}",
        "metadata.namespace": statefulset["metadata"]["namespace"],
    }
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
        else:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    argv = [_expand(arg, env) for arg in container["args"]]
    unresolved = [arg for arg in argv if "$(" in arg]
    assert not unresolved, f"variables without a value: {unresolved}"
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        local = tmp_path / mount["name"]
        local.mkdir(exist_ok=True)
        for item in secret["items"]:
            (local / item["path"]).write_text(SAMPLE_TOKEN + "\n")
        argv = [arg.replace(mount["mountPath"] + "/", f"{local}/") for arg in argv]
    return argv


# ------------------------------------------------------------------ rendering


def test_every_overlay_is_tested() -> None:
    assert {p.name for p in (KUBERNETES / "overlays").iterdir()} == set(OVERLAYS)


def test_overlay_renders_every_resource_into_the_namespace(overlay: Overlay) -> None:
    assert {(r["kind"], r["metadata"]["name"]) for r in overlay.resources} == EXPECTED
    for resource in overlay.resources:
        if resource["kind"] != "Namespace":
            assert resource["metadata"]["namespace"] == NAMESPACE, resource["metadata"]
    assert overlay.get("Namespace")["metadata"]["name"] == NAMESPACE


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (for kustomize)")
def test_renderer_agrees_with_kubectl_kustomize(overlay: Overlay) -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES / "overlays" / overlay.name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr

    def by_id(resources: list[dict]) -> dict[tuple, dict]:
        return {(r["kind"], r["metadata"]["name"]): r for r in resources}

    assert by_id(list(yaml.safe_load_all(result.stdout))) == by_id(overlay.resources)


def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    def kustomization(text: str) -> Path:
        (tmp_path / "kustomization.yaml").write_text(text)
        return tmp_path

    head = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
    base = f"resources: [{KUBERNETES / 'base'}]\n"
    with pytest.raises(Unsupported, match="images"):
        render(kustomization(head + "images: [{name: collectives, newTag: v2}]\n"))
    with pytest.raises(Unsupported, match="commonLabels"):
        render(kustomization(head + "commonLabels: {team: ml}\n"))
    delete = "kind: StatefulSet\nmetadata: {name: collectives-worker}\n$patch: delete\n"
    with pytest.raises(Unsupported, match="directives"):
        render(kustomization(head + base + f"patches: [{{patch: {json.dumps(delete)}}}]\n"))
    move = "[{op: move, from: /spec/replicas, path: /spec/x}]"
    target = "{kind: StatefulSet, name: collectives-worker}"
    with pytest.raises(Unsupported, match="move"):
        render(kustomization(head + base + f"patches: [{{target: {target}, patch: '{move}'}}]\n"))


# -------------------------------------------------------------------- schemas


def _service_monitor_validator() -> jsonschema.Validator:
    definitions = json.loads(
        (
            Path(kubernetes_validate.__file__).parent
            / f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local-strict/_definitions.json"
        ).read_text()
    )
    schema = json.loads((SCHEMAS / "servicemonitor-monitoring-v1.json").read_text())
    registry = referencing.Registry().with_resource(
        definitions["$id"], referencing.Resource.from_contents(definitions)
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_resources_validate_against_the_kubernetes_schemas(overlay: Overlay) -> None:
    for resource in overlay.resources:
        where = f"{overlay.name}: {resource['kind']}/{resource['metadata']['name']}"
        if resource["kind"] == "ServiceMonitor":
            # A CRD: kubernetes-validate has no schema for it (it raises
            # SchemaNotFoundError), so it is checked against ours.
            errors = [e.message for e in _service_monitor_validator().iter_errors(resource)]
            assert not errors, f"{where}: {errors}"
            continue
        try:
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
            continue
        except kubernetes_validate.ValidationError as exc:
            error = f"{where}: {'.'.join(str(p) for p in exc.path)}: {exc.message}"
        pytest.fail(error)


def test_service_monitor_schema_rejects_what_the_crd_rejects(overlay: Overlay) -> None:
    validator = _service_monitor_validator()
    monitor = overlay.get("ServiceMonitor")
    no_selector = {**monitor, "spec": {"endpoints": monitor["spec"]["endpoints"]}}
    bad_interval = json.loads(json.dumps(monitor))
    bad_interval["spec"]["endpoints"][0]["interval"] = "15 seconds"
    wrong_kind = {**monitor, "kind": "PodMonitor"}
    for bad in (no_selector, bad_interval, wrong_kind):
        assert not validator.is_valid(bad), bad


# ----------------------------------------------------------- daemon arguments


def test_daemon_command_lines_parse(overlay: Overlay, tmp_path: Path) -> None:
    coordinator = parse_coordinator(daemon_argv(overlay.statefulset("coordinator"), tmp_path))
    worker = parse_worker(daemon_argv(overlay.statefulset("worker"), tmp_path))
    for config in (coordinator, worker):
        assert config.host == "0.0.0.0" and config.metrics_host == "0.0.0.0"
        assert config.security.token == SAMPLE_TOKEN
    assert coordinator.dashboard_host == "0.0.0.0"
    assert worker.worker_token == SAMPLE_TOKEN


def test_coordinator_store_matches_the_overlay(overlay: Overlay, tmp_path: Path) -> None:
    args, _ = parse_daemon(daemon_argv(overlay.statefulset("coordinator"), tmp_path))
    if overlay.name.startswith("ha-"):
        assert args.store == "etcd://etcd:2379"
        assert args.cluster_name == "collectives"
    else:
        assert args.store == "memory"
        assert args.cluster_name == "default"  # unused with the memory store


def test_world_size_is_the_number_of_workers_less_one_spare(
    overlay: Overlay, tmp_path: Path
) -> None:
    """One live spare beyond the world: a drained or lost member's rank goes to it."""
    coordinator = parse_coordinator(daemon_argv(overlay.statefulset("coordinator"), tmp_path))
    replicas = overlay.statefulset("worker")["spec"]["replicas"]
    assert coordinator.min_workers == coordinator.max_workers == replicas - 1


def test_a_stopping_worker_drains_itself_onto_the_spare_in_time(
    overlay: Overlay, tmp_path: Path
) -> None:
    """The preStop hook is ``collectives drain`` of the pod's own advertised address,
    parsed by the real CLI; the grace period covers it and the SIGTERM drain."""
    from collectives.cli.main import _parser

    statefulset = overlay.statefulset("worker")
    spec = statefulset["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "worker"]
    shell, flag, script = container["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, flag) == ("sh", "-c")
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env |= {"POD_NAME": f"{statefulset['metadata']['name']}-1", "POD_NAMESPACE": NAMESPACE}
    words = shlex.split(script.split("||")[0])
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        words = [os.path.expandvars(w) for w in words]
    assert words[0] == "collectives"
    args = _parser().parse_args(words[1:])
    assert args.command == "drain" and not args.shrink
    _, config = parse_daemon(daemon_argv(statefulset, tmp_path, ordinal=1))
    assert args.worker == f"{config.advertise_host}:{_container_ports(statefulset)['grpc']}"
    assert args.coordinator == env["COORDINATOR_ADDRESSES"]
    assert args.token_file == "/etc/collectives/tokens/client-token"
    assert args.timeout > 0 and config.drain_timeout_s > 0
    assert spec["terminationGracePeriodSeconds"] > args.timeout + config.drain_timeout_s


def test_workers_list_every_coordinator_by_its_pod_name(overlay: Overlay, tmp_path: Path) -> None:
    coordinators = overlay.statefulset("coordinator")
    replicas = coordinators["spec"]["replicas"]
    assert replicas == COORDINATOR_REPLICAS[overlay.name.split("-")[0]]
    (value,) = [
        arg.split("=", 1)[1]
        for arg in daemon_argv(overlay.statefulset("worker"), tmp_path)
        if arg.startswith("--coordinator=")
    ]
    name, service = coordinators["metadata"]["name"], coordinators["spec"]["serviceName"]
    port = _container_ports(coordinators)["grpc"]
    assert value.split(",") == [f"{name}-{i}.{service}:{port}" for i in range(replicas)]


@pytest.mark.parametrize("component", ["coordinator", "worker"])
def test_daemons_advertise_their_stable_pod_names(
    overlay: Overlay, tmp_path: Path, component: str
) -> None:
    statefulset = overlay.statefulset(component)
    _, config = parse_daemon(daemon_argv(statefulset, tmp_path, ordinal=1))
    pod = f"{statefulset['metadata']['name']}-1"
    service = statefulset["spec"]["serviceName"]
    assert config.advertise_host == f"{pod}.{service}.{NAMESPACE}.svc"


# ------------------------------------------------------- ports, probes, names


def test_container_ports_are_the_daemons_ports(overlay: Overlay, tmp_path: Path) -> None:
    coordinators = overlay.statefulset("coordinator")
    coordinator = parse_coordinator(daemon_argv(coordinators, tmp_path))
    assert _container_ports(coordinators) == {
        "grpc": coordinator.port,
        "dashboard": coordinator.dashboard_port,
        "metrics": coordinator.metrics_port,
    }
    workers = overlay.statefulset("worker")
    worker = parse_worker(daemon_argv(workers, tmp_path))
    assert _container_ports(workers) == {
        "grpc": worker.port,
        "bulk": worker.bulk_port,
        "metrics": worker.metrics_port,
    }


@pytest.mark.parametrize("component", ["coordinator", "worker"])
def test_probes_ask_the_grpc_health_service(overlay: Overlay, component: str) -> None:
    container = _container(overlay.statefulset(component))
    grpc_port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        # No `service`: the overall status (""), which both daemons serve.
        assert container[probe]["grpc"] == {"port": grpc_port}, probe


@pytest.mark.parametrize("component", ["coordinator", "worker"])
def test_statefulset_is_governed_by_a_headless_service(overlay: Overlay, component: str) -> None:
    statefulset = overlay.statefulset(component)
    service = overlay.get("Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert _selects({"matchLabels": service["spec"]["selector"]}, _pod_labels(statefulset))
    assert _selects(statefulset["spec"]["selector"], _pod_labels(statefulset))


def test_service_ports_are_container_ports(overlay: Overlay) -> None:
    for service in overlay.all("Service"):
        (statefulset,) = [
            s
            for s in overlay.all("StatefulSet")
            if _selects({"matchLabels": service["spec"]["selector"]}, _pod_labels(s))
        ]
        ports = _container_ports(statefulset)
        for port in service["spec"]["ports"]:
            assert port["targetPort"] == port["name"], port
            assert ports[port["name"]] == port["port"], port
        assert {p["name"] for p in service["spec"]["ports"]} == set(ports)


def test_disruption_budgets_cover_each_statefulset(overlay: Overlay) -> None:
    covered = set()
    for budget in overlay.all("PodDisruptionBudget"):
        (statefulset,) = [
            s
            for s in overlay.all("StatefulSet")
            if _selects(budget["spec"]["selector"], _pod_labels(s))
        ]
        # A drain may take one pod at a time (a budget of 0 would block it).
        assert budget["spec"]["maxUnavailable"] == 1
        covered.add(statefulset["metadata"]["name"])
    assert covered == {s["metadata"]["name"] for s in overlay.all("StatefulSet")}


def test_network_policy_keeps_the_store_and_gloo_among_the_pods(overlay: Overlay) -> None:
    policy = overlay.get("NetworkPolicy")["spec"]
    statefulsets = overlay.all("StatefulSet")
    assert all(_selects(policy["podSelector"], _pod_labels(s)) for s in statefulsets)
    assert policy["policyTypes"] == ["Ingress"]
    public, internal = policy["ingress"]
    assert "from" not in public
    assert {p["port"] for p in public["ports"]} == PUBLIC_PORTS
    named = {name for s in statefulsets for name in _container_ports(s)}
    assert named >= PUBLIC_PORTS, "a public port that no container has"
    assert named == PUBLIC_PORTS, "an internal port is named: the policy below opens them"
    # All ports (the workers' stores, gloo's and NCCL's are ephemeral), from the collectives pods of
    # this namespace only: a podSelector without a namespaceSelector or ipBlock.
    assert "ports" not in internal
    (peer,) = internal["from"]
    assert set(peer) == {"podSelector"}
    assert all(_selects(peer["podSelector"], _pod_labels(s)) for s in statefulsets)


def test_service_monitor_scrapes_both_daemons(overlay: Overlay, tmp_path: Path) -> None:
    monitor = overlay.get("ServiceMonitor")["spec"]
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/metrics"
    selected = [
        s for s in overlay.all("Service") if _selects(monitor["selector"], s["metadata"]["labels"])
    ]
    assert {s["metadata"]["name"] for s in selected} == {
        "collectives-coordinator",
        "collectives-worker",
    }
    for service in selected:
        statefulset = overlay.get("StatefulSet", service["metadata"]["name"])
        _, config = parse_daemon(daemon_argv(statefulset, tmp_path))
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert ports[endpoint["port"]] == config.metrics_port


def test_gpu_overlays_request_a_gpu_and_cpu_overlays_none(overlay: Overlay) -> None:
    worker = _container(overlay.statefulset("worker"))
    limits = worker.get("resources", {}).get("limits", {})
    if overlay.name.endswith("-gpu"):
        assert limits["nvidia.com/gpu"] == 1
        assert worker["image"] == "collectives:cuda"
    else:
        assert "nvidia.com/gpu" not in json.dumps(overlay.resources)
        assert worker["image"] == "collectives:cpu"
    assert _container(overlay.statefulset("coordinator"))["image"] == "collectives:cpu"
