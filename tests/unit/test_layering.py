"""Who may import what: the wire package is what the SDK and the servers share.

The servers import of the SDK only the protocol: ``collectives.wire``,
``collectives.v1`` (the generated stubs), ``collectives.errors`` and
``collectives.reduce_ops``; the worker imports nothing of the coordinator (what
both need is in ``collectives_server.control_protocol``); the wire package and
the SDK's bulk client are leaves of the SDK.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from collectives.transport.bulk import BulkPort
from collectives.transport.roads import DataPath, choose_path
from collectives.v1 import worker_pb2
from collectives.wire.limits import BULK_MIN_BYTES

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


# What the daemons may import of the SDK: the protocol, nothing of the client.
_PROTOCOL = ("collectives.wire", "collectives.v1", "collectives.errors", "collectives.reduce_ops")


def _protocol(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in _PROTOCOL)


def _outside_the_protocol(paths: list[Path]) -> set[str]:
    return {
        f"{path.name}: {module}"
        for path in paths
        for module in _imports(path)
        if _ours(module)
        and module != "collectives"  # `from collectives import x`: x is checked itself
        and not _protocol(module)
    }


def test_the_servers_import_only_the_protocol_of_the_sdk() -> None:
    assert not _outside_the_protocol(sorted(SERVER.rglob("*.py")))


def test_the_protocol_check_finds_a_client_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from collectives.transport.shm import SegmentPool\nfrom collectives.wire import codec\n"
    )
    assert _outside_the_protocol([bad]) == {
        "bad.py: collectives.transport.shm",
        "bad.py: collectives.transport.shm.SegmentPool",
    }


# What the wire package and the SDK's bulk client may import of the SDK.
# (``collectives._deadlines`` is a leaf itself: the time left, over collectives.errors.)
_LEAF_DEPENDENCIES = (
    "collectives.wire",
    "collectives.errors",
    "collectives.wire.dtypes",
    "collectives._deadlines",
)


@pytest.mark.parametrize(
    "path",
    [*sorted((SDK / "wire").glob("*.py")), SDK / "transport" / "bulk.py"],
    ids=lambda p: p.name,
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
        return worker_pb2.DataPlaneResponse(bulk_port=self._bulk_port)


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


# ----------------------------------------------------------- the tree is the map
def _modules(base: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``base/package``."""
    found = {}
    for path in (base / package).rglob("*.py"):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(base: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, anywhere in its body (lazy and
    ``TYPE_CHECKING`` imports included). ``from pkg import sub`` is an edge to the
    submodule ``sub`` when it is one, else to ``pkg``."""
    modules = _modules(base, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                names = [s for s in subs if s in modules]
                if len(names) < len(subs):
                    names.append(node.module)
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    deps.add(name)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize(
    ("base", "package"), [(ROOT / "client", "collectives"), (ROOT / "server", "collectives_server")]
)
def test_no_import_cycles(base: Path, package: str) -> None:
    assert cycles(import_graph(base, package)) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


# The worker's layers, lowest first (see collectives_server/worker/__init__.py): a
# module imports from its own layer and the ones below only.
_WORKER = "collectives_server.worker"
_STATE = ("config", "context", "telemetry", "stats", "status", "metrics")
_DAEMON = ("daemon", "enrolment", "heartbeats", "drain_role")
WORKER_LAYERS = ("data", "transport", "kernels", "models", "engine", _STATE, "rpc", _DAEMON)


def worker_layer(module: str) -> int | None:
    """The layer of a worker module (None: not a worker module)."""
    if not module.startswith(_WORKER + "."):
        return None
    top = module.removeprefix(_WORKER + ".").split(".")[0]
    for i, layer in enumerate(WORKER_LAYERS):
        if top == layer or (isinstance(layer, tuple) and top in layer):
            return i
    raise AssertionError(f"{module} is in no layer of WORKER_LAYERS: place it")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in sorted(graph.items()):
        mine = worker_layer(module)
        if mine is None:
            continue
        for dep in sorted(deps):
            theirs = worker_layer(dep)
            if theirs is not None and theirs > mine:
                bad.append(f"{module} ({mine}) imports {dep} ({theirs})")
    return bad


def test_the_worker_layers_hold() -> None:
    assert layer_violations(import_graph(ROOT / "server", "collectives_server")) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {
        f"{_WORKER}.data.store": {f"{_WORKER}.engine.sequencer"},
        f"{_WORKER}.engine.sequencer": {f"{_WORKER}.data.store"},
    }
    assert layer_violations(graph) == [
        f"{_WORKER}.data.store (0) imports {_WORKER}.engine.sequencer (4)"
    ]


def test_the_worker_root_is_only_its_composition_root() -> None:
    root = SERVER / "worker"
    files = {p.stem for p in root.glob("*.py")} - {"__init__"}
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    assert files == (set(_STATE) | set(_DAEMON)) - packages


@pytest.mark.parametrize(
    "init", sorted(SERVER.rglob("__init__.py")), ids=lambda p: str(p.parent.relative_to(SERVER))
)
def test_every_package_has_its_module_table(init: Path) -> None:
    """Each package's docstring names each of its modules and subpackages once."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    package = init.parent
    names = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
    names |= {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(n for n in names if f"``{n}``" not in doc)
    assert not missing, f"{init.relative_to(ROOT)}: add {missing} to its module table"


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test files by basename (no packages): two of one name collide."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def _wire_modules_used_by(paths: list[Path]) -> set[str]:
    """The ``collectives.wire`` modules ``paths`` import, and those these import in turn."""
    wire = {f"collectives.wire.{p.stem}": p for p in (SDK / "wire").glob("*.py")}
    wire.pop("collectives.wire.__init__")
    used = {m for path in paths for m in _imports(path) if m in wire}
    todo = list(used)
    while todo:
        for dep in _imports(wire[todo.pop()]):
            if dep in wire and dep not in used:
                used.add(dep)
                todo.append(dep)
    return used


def test_every_wire_module_serves_both_sides() -> None:
    """``wire`` holds the protocol only: what both the SDK and the daemons use. What one
    side alone needs lives on that side (the flight-record reader is the SDK's)."""
    outside = [p for p in SDK.rglob("*.py") if "wire" not in p.parts and "v1" not in p.parts]
    sdk = _wire_modules_used_by(outside)
    server = _wire_modules_used_by(sorted(SERVER.rglob("*.py")))
    every = {f"collectives.wire.{p.stem}" for p in (SDK / "wire").glob("*.py")} - {
        "collectives.wire.__init__"
    }
    assert sorted(every - sdk) == [], "wire modules the SDK does not use"
    assert sorted(every - server) == [], "wire modules the daemons do not use"


# The SDK's layers, lowest first (see collectives/session/__init__.py): a module
# imports from its own layer and the ones below only. Layer 0 is the protocol and the
# leaves every layer may use.
_SDK = "collectives"
SDK_LAYERS: tuple[tuple[str, ...], ...] = (
    ("wire", "v1", "errors", "reduce_ops", "addresses", "work", "groups", "_deadlines",
     "_progress", "_validation"),
    ("transport",),
    ("session",),
    ("ops",),
    ("models", "data_parallel"),
    ("observe", "flight_record"),
    ("cluster", ""),
    ("cli",),
)  # fmt: skip


def sdk_layer(module: str) -> int:
    """The layer of an SDK module (``collectives`` itself: the facade's)."""
    top = module.removeprefix(_SDK).removeprefix(".").split(".")[0]
    for i, layer in enumerate(SDK_LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module} is in no layer of SDK_LAYERS: place it")


def sdk_layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} ({sdk_layer(module)}) imports {dep} ({sdk_layer(dep)})"
        for module, deps in sorted(graph.items())
        for dep in sorted(deps)
        if sdk_layer(dep) > sdk_layer(module)
    ]


def test_the_sdk_layers_hold() -> None:
    assert sdk_layer_violations(import_graph(ROOT / "client", _SDK)) == []


def test_the_sdk_layer_check_finds_an_upward_import() -> None:
    graph = {"collectives.transport.lanes": {"collectives.models.part"}}
    assert sdk_layer_violations(graph) == [
        "collectives.transport.lanes (1) imports collectives.models.part (4)"
    ]


@pytest.mark.parametrize(
    "init", sorted(SDK.rglob("__init__.py")), ids=lambda p: str(p.parent.relative_to(SDK))
)
def test_every_sdk_package_has_its_module_table(init: Path) -> None:
    if init.parent == SDK or init.parent.name == "v1":
        return  # the root's docstring is the API's; v1 is generated
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    names = {p.stem for p in init.parent.glob("*.py")} - {"__init__", "__main__"}
    missing = sorted(n for n in names if f":mod:`.{n}`" not in doc and f"``{n}``" not in doc)
    assert not missing, f"{init.relative_to(ROOT)}: add {missing} to its module table"
