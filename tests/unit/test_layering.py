"""Who may import what: the wire package is what the SDK and the servers share.

The servers import the SDK's public modules only (no ``collectives._*``); the
wire package and the SDK's bulk client are leaves; ``collectives.codec`` still
offers what it offered before the codec moved to ``collectives.wire.codec``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import collectives.codec
from collectives.wire import codec as wire_codec

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "client" / "collectives"
SERVER = ROOT / "server" / "collectives_server"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _ours(module: str) -> bool:
    return module == "collectives" or module.startswith("collectives.")


def test_the_servers_import_no_private_sdk_module() -> None:
    bad = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in SERVER.rglob("*.py")
        for module in _imports(path)
        if _ours(module) and any(part.startswith("_") for part in module.split(".")[1:])
    }
    assert not bad


# What the wire package and the SDK's bulk client may import of the SDK.
_LEAF_DEPENDENCIES = ("collectives.wire", "collectives.errors", "collectives.dtypes")


@pytest.mark.parametrize(
    "path", [*sorted((SDK / "wire").glob("*.py")), SDK / "bulk.py"], ids=lambda p: p.name
)
def test_wire_and_bulk_are_leaves_of_the_sdk(path: Path) -> None:
    bad = {
        module
        for module in _imports(path)
        if _ours(module)
        and module != "collectives"  # `from collectives import x`: x is checked itself
        and not module.startswith(("collectives.v1", *_LEAF_DEPENDENCIES))
    }
    assert not bad


def test_collectives_codec_reexports_the_wire_codec() -> None:
    assert collectives.codec.__all__ == wire_codec.__all__
    for name in wire_codec.__all__:
        assert getattr(collectives.codec, name) is getattr(wire_codec, name)
