"""How the SDK is put together: ``Cluster`` by composition, and no reach-ins.

``Cluster`` holds a session and its parts (``collectives.session.connection``) instead of
inheriting them, and no SDK module reads another module's or object's
``_private`` names: what one part needs of another is a public name.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch
from sdk_fakes import start_deployment

import collectives
from collectives.models.part import Models
from collectives.observe.operations import Operations
from collectives.ops.collectives import Collectives
from collectives.ops.data_plane import DataPlane
from collectives.ops.p2p import PeerToPeer
from collectives.session import connection as _session
from collectives.session.views import ClusterView

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "client" / "collectives"

# Underscore names that belong to third-party protocols, not to our modules.
ALLOWED_PRIVATE_ATTRIBUTES = frozenset(
    (
        # namedtuple's public API is spelled with a leading underscore.
        "_fields",
        "_make",
        "_asdict",
        "_replace",
        # torch.Tensor's in-place version counter (what autograd checks saved tensors with).
        "_version",
    )
)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath("client", *dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def private_reach_ins(path: Path, shown_as: str) -> list[str]:
    """``x._name`` with ``x`` not ``self``/``cls``, and ``from collectives.m import _name``
    of something that is not a module, in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or _is_dunder(name) or name in ALLOWED_PRIVATE_ATTRIBUTES:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{shown_as}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module != "collectives" and not node.module.startswith("collectives."):
                continue
            for alias in node.names:
                name = alias.name
                private = name.startswith("_") and not _is_dunder(name)
                if private and not _is_module(f"{node.module}.{name}"):
                    found.append(f"{shown_as}:{node.lineno}: from {node.module} import {name}")
    return found


def _sdk_files() -> list[Path]:
    return sorted(p for p in SDK.rglob("*.py") if p.relative_to(SDK).parts[0] != "v1")


def test_no_sdk_module_reaches_into_private_names() -> None:
    found = [
        hit for path in _sdk_files() for hit in private_reach_ins(path, str(path.relative_to(SDK)))
    ]
    assert found == []


def test_the_reach_in_check_finds_attributes_and_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from collectives.session.connection import _left\n"
        "from collectives import _progress as progress\n"  # a module: fine
        "def f(cluster, point):\n"
        "    point._asdict()\n"  # namedtuple protocol: fine
        "    cluster.__class__\n"  # dunder: fine
        "    return cluster._session\n"
    )
    assert private_reach_ins(bad, "bad.py") == [
        "bad.py:1: from collectives.session.connection import _left",
        "bad.py:6: cluster._session",
    ]


def test_cluster_is_composed_not_inherited() -> None:
    assert collectives.Cluster.__bases__ == (object,)


def test_the_session_implementation_has_every_name_of_the_protocol() -> None:
    declared = {
        name for name in vars(_session.Session) if not name.startswith("_") and name not in ("mro",)
    }
    assert declared, "the Session protocol declares nothing"
    missing = sorted(n for n in declared if not hasattr(_session.ClusterSession, n))
    assert missing == []


def test_the_parts_work_alone_on_a_session() -> None:
    """A session and the parts it needs, without ``Cluster``, against the fake workers."""
    deployment = start_deployment(world_size=2)
    session = _session.ClusterSession(deployment.coordinator_address, timeout=10)
    try:
        data_plane = DataPlane(session)
        collectives_part = Collectives(session, data_plane)
        data_plane.put("x", torch.ones(3))
        collectives_part.all_reduce("x")
        assert data_plane.get("x", rank=1).tolist() == [2.0, 2.0, 2.0]
        assert deployment.fake.stores[0]["x"].tolist() == [2.0, 2.0, 2.0]
    finally:
        session.close()
        deployment.stop()
    assert session.closed


def test_each_public_call_is_written_once_in_its_part() -> None:
    """``Cluster``'s calls are its parts' methods, signature and docstring copied when
    the class is made: a keyword or a sentence added to a part reaches
    ``help(cluster.x)`` and ``docs/api.md``'s checks without a second edit."""
    parts = (DataPlane, Collectives, PeerToPeer, Models, Operations, ClusterView)
    delegated = {}
    for name, attr in vars(collectives.Cluster).items():
        wrapped = getattr(attr, "__wrapped__", None)
        if wrapped is not None:
            delegated[name] = wrapped
    assert len(delegated) >= 30, sorted(delegated)
    for name, method in delegated.items():
        assert any(vars(part).get(name) is method for part in parts), name
        mine = getattr(collectives.Cluster, name)
        assert mine.__doc__ is method.__doc__, name
        assert inspect.signature(mine) == inspect.signature(method), name
    views = {n: a for n, a in vars(ClusterView).items() if isinstance(a, property)}
    for name, prop in views.items():
        assert getattr(collectives.Cluster, name).__doc__ is prop.__doc__, name
