"""Who may import what: the wire package is what the SDK and the servers share.

The servers import the SDK's public modules only (no ``collectives._*``); the
worker imports nothing of the coordinator (what both need is in
``collectives_server.control_protocol``); the wire package and the SDK's bulk
client are leaves; ``collectives.codec`` still
offers what it offered before the codec moved to ``collectives.wire.codec``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import collectives.codec
from collectives._transport import DataPath, choose_path
from collectives.bulk import BulkPort
from collectives.wire import codec as wire_codec
from collectives.wire.bulk_frames import BULK_MIN_BYTES

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


def test_the_worker_imports_nothing_of_the_coordinator() -> None:
    bad = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in (SERVER / "worker").rglob("*.py")
        for module in _imports(path)
        if module.startswith("collectives_server.coordinator")
    }
    assert not bad


# What the wire package and the SDK's bulk client may import of the SDK.
# (``collectives._deadlines`` is a leaf itself: the time left, over collectives.errors.)
_LEAF_DEPENDENCIES = (
    "collectives.wire",
    "collectives.errors",
    "collectives.dtypes",
    "collectives._deadlines",
)


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


class _Endpoint:
    """What choose_path asks of a worker endpoint; counts GetDataPlane calls."""

    def __init__(self, bulk_port: int) -> None:
        self.address = "127.0.0.1:1"
        self.bulk = BulkPort()
        self.stub = self
        self.asked = 0
        self._bulk_port = bulk_port

    def GetDataPlane(self, request, timeout):  # noqa: N802 - the RPC's name
        self.asked += 1
        return type("DataPlaneResponse", (), {"bulk_port": self._bulk_port})()


def test_choose_path_prefers_shared_memory_then_the_bulk_port_then_the_stream() -> None:
    endpoint = _Endpoint(bulk_port=4242)
    route = choose_path(endpoint, 5.0, nbytes=BULK_MIN_BYTES, shared_memory=True)
    assert route.path is DataPath.SHM and endpoint.asked == 0
    assert choose_path(endpoint, 5.0, nbytes=BULK_MIN_BYTES - 1).path is DataPath.STREAM
    assert endpoint.asked == 0  # a small put does not even ask for the port
    route = choose_path(endpoint, 5.0, nbytes=BULK_MIN_BYTES)
    assert (route.path, route.bulk_port) == (DataPath.BULK, 4242)
    assert choose_path(endpoint, 5.0, nbytes=None).path is DataPath.BULK  # a get
    assert endpoint.asked == 1  # asked once per channel
    endpoint.bulk.suspend(60.0)
    assert choose_path(endpoint, 5.0, nbytes=None).path is DataPath.STREAM


def test_choose_path_streams_to_a_worker_without_a_bulk_port() -> None:
    endpoint = _Endpoint(bulk_port=0)
    assert choose_path(endpoint, 5.0, nbytes=BULK_MIN_BYTES).path is DataPath.STREAM
    assert choose_path(endpoint, 5.0, nbytes=None).path is DataPath.STREAM
