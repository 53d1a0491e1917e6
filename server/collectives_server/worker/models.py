"""Models hosted by a worker: loading, retained autograd graphs, optimizer state.

Models arrive as ``torch.export`` archives (JSON graph + raw weight bytes; an
archive that carries pickled data is refused, since unpickling executes code)
or are built by a server-side factory that the operator allowed with
``--allow-factory pkg.module``. A forward run with autograd keeps its graph
until the client's backward, an explicit release, or ``graph_ttl_s`` — so a
client that never calls backward cannot leak a worker's memory.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import json
import threading
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from collectives.errors import InvalidArgument, NotFound, PermissionDenied
from collectives.names import validate_name

__all__ = ["ModelRegistry", "HostedModel", "RetainedGraph", "OPTIMIZERS"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
# Entries torch.export.save writes with torch.save (zip/pickle format).
_PICKLED_ENTRY_SUFFIXES = (".pt", ".pkl", ".pickle")


@dataclass
class RetainedGraph:
    outputs: dict[str, torch.Tensor]  # stored output name -> output tensor (with grad_fn)
    inputs: dict[str, torch.Tensor]  # input name -> leaf tensor whose grad the client wants
    expires_at: float


@dataclass
class HostedModel:
    name: str
    module: nn.Module
    source: str
    devices: list[torch.device]
    lock: threading.RLock = field(default_factory=threading.RLock)
    graphs: dict[str, RetainedGraph] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    optimizer_kind: str = ""
    optimizer_hyper: dict[str, Any] = field(default_factory=dict)
    steps: int = 0

    @property
    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def signature(self) -> int:
        """A hash of parameter names, dtypes and shapes: equal on every rank that loaded it."""
        text = ";".join(f"{n}:{p.dtype}:{tuple(p.shape)}" for n, p in self.parameters)
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def check_archive(data: bytes) -> None:
    """Refuses archives that could make ``torch.export.load`` execute code.

    ``torch.export.load`` unpickles weights whose config says ``use_pickle``,
    and when its restricted (``weights_only=True``) load of the sample inputs
    fails it *falls back to a full unpickle*. So: every config must say
    ``use_pickle: false``, and every pickle-format entry (the sample inputs)
    must load with ``weights_only=True`` here first; then torch never reaches
    its fallback.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        raise InvalidArgument(
            "the model archive is not a torch.export archive (not a zip file); "
            "create it with torch.export.save, or load the model with a factory"
        ) from None
    if not any(i.filename.endswith(".json") and "/models/" in i.filename for i in infos):
        raise InvalidArgument("the model archive has no models/*.json: not a torch.export archive")
    for info in infos:
        try:
            body = archive.read(info)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise InvalidArgument(
                f"model archive entry {info.filename!r} is corrupt: {exc}"
            ) from None
        if info.filename.endswith("_config.json"):
            try:
                config = json.loads(body or b"{}")
            except json.JSONDecodeError:
                raise InvalidArgument(
                    f"model archive entry {info.filename!r} is not JSON"
                ) from None
            entries = config.get("config", {}) if isinstance(config, dict) else {}
            if any(isinstance(v, dict) and v.get("use_pickle") for v in entries.values()):
                raise InvalidArgument(
                    f"the model archive stores pickled objects ({info.filename}); this "
                    "service never unpickles. Export a model whose weights are plain tensors, "
                    "or use a factory"
                )
        elif body and info.filename.endswith(_PICKLED_ENTRY_SUFFIXES):
            # torch.export.load unpickles these (the sample inputs); raw weight
            # entries are governed by the configs' use_pickle checked above.
            try:
                torch.load(io.BytesIO(body), weights_only=True)
            except Exception:
                raise InvalidArgument(
                    f"the model archive entry {info.filename!r} holds pickled data that is "
                    "not plain tensors; this service never unpickles arbitrary objects"
                ) from None


def load_exported(data: bytes) -> nn.Module:
    check_archive(data)
    try:
        return torch.export.load(io.BytesIO(data)).module()
    except Exception as exc:
        raise InvalidArgument(
            f"could not load the torch.export archive: {type(exc).__name__}: {exc}"
        ) from None


def build_from_factory(factory: str, kwargs_json: str, allowed: tuple[str, ...]) -> nn.Module:
    module_name, _, fn_name = factory.partition(":")
    if not module_name or not fn_name:
        raise InvalidArgument(f"factory {factory!r} must look like 'pkg.module:function'")
    if not any(module_name == a or module_name.startswith(a + ".") for a in allowed):
        raise PermissionDenied(
            f"factory module {module_name!r} is not allowed on this worker; start it with "
            f"--allow-factory {module_name}"
            + (f" (allowed: {', '.join(allowed)})" if allowed else " (none allowed)")
        )
    try:
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"factory kwargs are not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise InvalidArgument("factory kwargs must be a JSON object")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise NotFound(f"factory {factory!r} not found on this worker: {exc}") from None
    try:
        module = fn(**kwargs)
    except TypeError as exc:
        raise InvalidArgument(f"factory {factory!r} rejected its arguments: {exc}") from None
    if not isinstance(module, nn.Module):
        raise InvalidArgument(
            f"factory {factory!r} returned {type(module).__name__}, not a torch.nn.Module"
        )
    return module


def make_optimizer(model: HostedModel, kind: str, hyper: dict[str, Any]) -> torch.optim.Optimizer:
    cls = OPTIMIZERS.get(kind)
    if cls is None:
        raise InvalidArgument(f"unknown optimizer {kind!r}; use one of: {', '.join(OPTIMIZERS)}")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    unknown = sorted(set(hyper) - accepted)
    if unknown:
        raise InvalidArgument(
            f"optimizer {kind} does not take {', '.join(unknown)}; it accepts: "
            + ", ".join(sorted(accepted))
        )
    try:
        return cls(model.module.parameters(), **hyper)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"optimizer {kind}: {exc}") from None


class ModelRegistry:
    def __init__(
        self,
        devices: list[torch.device],
        allowed_factories: tuple[str, ...] = (),
        graph_ttl_s: float = 60.0,
    ) -> None:
        self.devices = devices
        self.allowed_factories = allowed_factories
        self.graph_ttl_s = graph_ttl_s
        self._models: dict[str, HostedModel] = {}
        self._lock = threading.Lock()

    def add(self, name: str, module: nn.Module, source: str) -> HostedModel:
        validate_name(name, "model name")
        module = module.to(self.devices[0])
        hosted = HostedModel(name, module, source, list(self.devices))
        with self._lock:
            self._models[name] = hosted
        return hosted

    def get(self, name: str) -> HostedModel:
        with self._lock:
            model = self._models.get(name)
        if model is None:
            raise NotFound(f"model {name!r} is not loaded on this worker; load_model it first")
        return model

    def peek(self, name: str) -> HostedModel | None:
        with self._lock:
            return self._models.get(name)

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._models.pop(name, None) is not None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def all(self) -> list[HostedModel]:
        with self._lock:
            return list(self._models.values())

    def graphs_retained(self) -> int:
        return sum(len(m.graphs) for m in self.all())

    def expire_graphs(self, now: float | None = None) -> int:
        """Drops graphs whose backward never came within ``graph_ttl_s``."""
        now = time.monotonic() if now is None else now
        dropped = 0
        for model in self.all():
            with model.lock:
                for call_id in [c for c, g in model.graphs.items() if g.expires_at <= now]:
                    del model.graphs[call_id]
                    dropped += 1
        return dropped
