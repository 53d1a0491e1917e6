"""Modules a drain's successor builds while the drain prepares.

A worker that joins a generation gets each model's weights from its peers
(``engine.model_sync``), but must first build the module: an exported model's
archive checked (its trial load is a process of its own) and loaded, or a factory
run. Calls waiting for the model there feel that. A drain's successor therefore
builds ahead: its copy ahead also fetches how each model the drained worker hosts
is built, with each exported model's archive, and it builds the modules then, while
the drained worker still serves. When the exchange after the seal sends it a model,
hosting it takes the module built ahead from the same definition (for an archive,
the same bytes: compared by SHA-256) and only commits the weights it received.
Anything else, or a definition that changed since, is built as before.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from collectives.v1 import worker_pb2
from collectives.wire.codec import tensor_memoryview
from collectives_server.worker.models.archive.upload import ModelUploads
from collectives_server.worker.models.registry import build_from_factory

__all__ = ["BuiltModule", "ModulesBuiltAhead"]

log = logging.getLogger(__name__)

# (factory, its kwargs as JSON, the archive's SHA-256): what a module was built from.
_Key = tuple[str, str, str]


@dataclass(frozen=True)
class BuiltModule:
    module: nn.Module
    archive: Path | None  # an exported model's checked archive, kept for the next joiner


def _key(factory: str, kwargs_json: str, archive: torch.Tensor | None) -> _Key:
    digest = "" if archive is None else hashlib.sha256(tensor_memoryview(archive)).hexdigest()
    return (factory, kwargs_json, digest)


class ModulesBuiltAhead:
    """The modules built ahead, each taken at most once (:meth:`take`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: dict[_Key, BuiltModule] = {}

    def build(
        self,
        builds: Iterable[worker_pb2.ModelSpec],
        archives: dict[str, torch.Tensor],
        uploads: ModelUploads,
        allowed_factories: tuple[str, ...],
        still_wanted: Callable[[], bool],
    ) -> list[str]:
        """Builds each model of ``builds`` (an exported one from its archive in
        ``archives``); keeps them while ``still_wanted()``. Returns the names built; a
        model that cannot be built here is logged and left to the exchange."""
        built = []
        for b in builds:
            archive = archives.get(b.name)
            if not b.factory and archive is None:
                continue
            try:
                if b.factory:
                    limit = uploads.config.max_bytes
                    module = build_from_factory(
                        b.factory, b.factory_kwargs_json, allowed_factories, max_bytes=limit
                    )
                    made = BuiltModule(module, None)
                else:
                    made = BuiltModule(*uploads.load_peer_archive(archive))
            except Exception as exc:
                log.warning("cannot build model %r ahead (built when it arrives): %s", b.name, exc)
                continue
            if not still_wanted():  # (its drain ended meanwhile)
                _discard(made)
                break
            key = _key(b.factory, b.factory_kwargs_json, None if b.factory else archive)
            with self._lock:
                replaced = self._built.get(key)
                self._built[key] = made
            if replaced is not None:
                _discard(replaced)
            built.append(b.name)
        return built

    def take(
        self, factory: str, kwargs_json: str, archive: torch.Tensor | None
    ) -> BuiltModule | None:
        """The module built ahead from this definition (None if none was)."""
        with self._lock:
            if not self._built:
                return None
        key = _key(factory, kwargs_json, None if factory else archive)
        with self._lock:
            return self._built.pop(key, None)

    def clear(self) -> None:
        """Drops every module not taken (its drain ended, or was called off)."""
        with self._lock:
            dropped, self._built = list(self._built.values()), {}
        for made in dropped:
            _discard(made)


def _discard(made: BuiltModule) -> None:
    if made.archive is not None:
        made.archive.unlink(missing_ok=True)
