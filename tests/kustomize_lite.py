"""Just enough kustomize to render deploy/kubernetes without the kustomize binary.

It implements what those kustomizations use and nothing else: ``resources``
(files and directories), ``components``, ``namespace``, and ``patches`` that are
strategic-merge patches of StatefulSets (matched by kind and name) or JSON 6902
patches (add/replace/remove) with a kind-and-name target. Every other field,
directive or operation raises :class:`Unsupported`, so a kustomization that
starts using a feature fails here loudly instead of rendering something else
than ``kubectl apply -k`` would. tests/unit/test_deploy_manifests.py also
compares this output with ``kubectl kustomize`` wherever kubectl is installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Unsupported", "render"]

Resource = dict[str, Any]

_FIELDS = {
    "Kustomization": {"apiVersion", "kind", "resources", "components", "patches", "namespace"},
    "Component": {"apiVersion", "kind", "resources", "patches"},
}
_API_VERSIONS = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Component": "kustomize.config.k8s.io/v1alpha1",
}
# The patchMergeKey of the PodSpec and Container lists a patch may touch; lists
# of other fields that kustomize replaces whole (no merge key).
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
_REPLACED_LISTS = {"args", "command", "tolerations"}
_CLUSTER_SCOPED = {"Namespace"}


class Unsupported(Exception):
    """The kustomization uses something this renderer does not implement."""


def render(directory: Path) -> list[Resource]:
    """The resources ``kubectl kustomize DIRECTORY`` prints, in kustomize's order of input."""
    return _build(directory, "Kustomization", [])


def _build(directory: Path, kind: str, accumulated: list[Resource]) -> list[Resource]:
    path = directory / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text())
    if spec.get("kind") != kind or spec.get("apiVersion") != _API_VERSIONS[kind]:
        raise Unsupported(f"{path}: expected {_API_VERSIONS[kind]} {kind}")
    unknown = set(spec) - _FIELDS[kind]
    if unknown:
        raise Unsupported(f"{path}: fields {sorted(unknown)} are not implemented")
    resources = accumulated
    for entry in spec.get("resources", []):
        source = directory / entry
        if source.is_dir():
            resources.extend(_build(source, "Kustomization", []))
        else:
            resources.extend(doc for doc in yaml.safe_load_all(source.read_text()) if doc)
    for entry in spec.get("components", []):
        _build(directory / entry, "Component", resources)
    for patch in spec.get("patches", []):
        _apply_patch(directory, path, patch, resources)
    if "namespace" in spec:
        for resource in resources:
            if resource["kind"] not in _CLUSTER_SCOPED:
                resource["metadata"]["namespace"] = spec["namespace"]
    _check_unique(path, resources)
    return resources


def _check_unique(path: Path, resources: list[Resource]) -> None:
    seen = set()
    for r in resources:
        key = (r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"])
        if key in seen:
            raise ValueError(f"{path}: {key} appears twice")
        seen.add(key)


def _apply_patch(directory: Path, path: Path, entry: dict, resources: list[Resource]) -> None:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown or ("path" in entry) == ("patch" in entry):
        raise Unsupported(f"{path}: a patch needs exactly one of path/patch, got {sorted(entry)}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    target = entry.get("target")
    if len(docs) == 1 and isinstance(docs[0], list):
        if target is None:
            raise Unsupported(f"{path}: a JSON 6902 patch needs a target")
        resource = _find(path, resources, target)
        for op in docs[0]:
            _json6902(path, resource, op)
        return
    if target is not None:
        raise Unsupported(f"{path}: targets of strategic-merge patches are not implemented")
    for doc in docs:
        if doc.get("kind") != "StatefulSet":
            raise Unsupported(f"{path}: strategic merge of a {doc.get('kind')} is not implemented")
        resource = _find(path, resources, {"kind": doc["kind"], "name": doc["metadata"]["name"]})
        merged = _merge(resource, doc, "")
        resource.clear()
        resource.update(merged)


def _find(path: Path, resources: list[Resource], target: dict) -> Resource:
    if set(target) != {"kind", "name"}:
        raise Unsupported(f"{path}: patch targets other than kind+name: {target}")
    found = [
        r
        for r in resources
        if r["kind"] == target["kind"] and r["metadata"]["name"] == target["name"]
    ]
    if len(found) != 1:
        raise ValueError(f"{path}: {len(found)} resources match the patch target {target}")
    return found[0]


def _merge(base: Any, patch: Any, field: str) -> Any:
    """Strategic merge of ``patch`` into ``base`` (a new value; neither is changed)."""
    if isinstance(patch, dict):
        directives = [key for key in patch if key.startswith("$")]
        if directives:
            raise Unsupported(f"strategic-merge directives {directives} are not implemented")
        if not isinstance(base, dict):
            return copy.deepcopy(patch)
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = _merge(base.get(key), value, key)
        return merged
    if isinstance(patch, list):
        if field in _REPLACED_LISTS or not isinstance(base, list):
            return copy.deepcopy(patch)
        key = _MERGE_KEYS.get(field)
        if key is None:
            raise Unsupported(f"merging the list {field!r} is not implemented")
        # As kustomize orders them: the patch's items (merged into the base's
        # items of the same key), then the base's other items.
        by_key = {item[key]: item for item in base}
        patched = [_merge(by_key.get(item[key]), item, "") for item in patch]
        keys = {item[key] for item in patch}
        return patched + [copy.deepcopy(item) for item in base if item[key] not in keys]
    return patch


def _json6902(path: Path, resource: Resource, op: dict) -> None:
    if op.get("op") not in ("add", "replace", "remove"):
        raise Unsupported(f"{path}: JSON 6902 op {op.get('op')!r} is not implemented")
    *parents, last = [
        part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]
    ]
    node: Any = resource
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op["op"] == "add":
            node.insert(index, copy.deepcopy(op["value"]))
        elif op["op"] == "replace":
            node[index] = copy.deepcopy(op["value"])
        else:
            del node[index]
    elif op["op"] == "remove":
        del node[last]
    else:
        if op["op"] == "replace" and last not in node:
            raise ValueError(f"{path}: replace of a missing {op['path']}")
        node[last] = copy.deepcopy(op["value"])
