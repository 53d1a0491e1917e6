"""Exported programs: how the SDK ships code to the workers without pickle.

A model (``load_model``), a function run on the workers' tensors
(``Cluster.apply``) and a custom loss (``train_step(loss=...)``) all travel
the same way: ``torch.export`` turns them into an ``ExportedProgram`` archive
(the graph's operators and its weights as tensors, no Python objects), and the
workers check its operators against their allowlist before loading it. A
function is wrapped in an ``nn.Module`` first and loaded under a reserved
model name, ``__fn/<digest of its archive>``.

Exporting is the slow part of a load (``torch.export`` traces the module), so
a client exports each module once per input signature and set of weights:
:class:`ProgramCache` keys an archive by the module's identity, the inputs'
dtypes and shapes (the batch dimension, 0 unless ``load_model(batch_dim=)``
says otherwise, is dynamic, so it is left out), the batch dimension, the training
flag and every parameter's and buffer's in-place version counter and storage
(a changed weight is a new archive).
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map, tree_structure

from collectives.errors import InvalidArgument
from collectives.v1 import worker_pb2
from collectives.wire.dtypes import from_wire
from collectives.wire.names import FUNCTION_PREFIX

__all__ = [
    "FunctionModule",
    "ProgramCache",
    "as_module",
    "checked_batch_dim",
    "example_like",
    "export_archive",
    "program_name",
]

# Archives kept per client: enough for the functions and models of a program,
# bounded so a loop that makes a new function per call does not grow forever.
MAX_CACHED_PROGRAMS = 64


class FunctionModule(nn.Module):
    """A plain function as a module, so ``torch.export`` can export it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def as_module(fn: object, what: str) -> nn.Module:
    """``fn`` itself if it is a module, else ``fn`` wrapped in one.

    Raises:
        InvalidArgument: ``fn`` is neither a module nor callable.
    """
    if isinstance(fn, nn.Module):
        return fn
    if callable(fn):
        return FunctionModule(fn)
    raise InvalidArgument(f"{what} must be an nn.Module or a function, got {type(fn).__name__}")


def example_like(info: worker_pb2.TensorInfo) -> torch.Tensor:
    """A tensor of ``info``'s dtype and shape, of small random values, to trace with."""
    dtype = from_wire(info.dtype)
    shape = tuple(info.shape)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    return torch.randint(0, 2, shape, dtype=dtype)  # small: valid class indices too


def checked_batch_dim(dim: object) -> int:
    """``dim`` if it can name a tensor dimension (an int; negative counts from the end).

    Raises:
        InvalidArgument: ``dim`` is not an int.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise InvalidArgument(f"batch_dim must be an int, got {dim!r}")
    return dim


def _batch_axis(t: torch.Tensor, dim: int) -> int | None:
    """Which axis of ``t`` is dimension ``dim`` (negative: from the end); None if it has none."""
    if -t.dim() <= dim < t.dim():
        return dim % t.dim()
    return None


# One export at a time in a process: torch.export traces under process-wide dispatch
# modes, and two threads' exports at once (two clients' load_model) fail ("slot
# already occupied").
_EXPORTING = threading.Lock()


def export_archive(module: nn.Module, example_inputs: Any, dim: int = 0) -> bytes:
    """A torch.export archive of ``module`` with dimension ``dim`` of every tensor input dynamic.

    ``dim`` is the batch dimension ``data_parallel(name, dim=)`` splits along;
    the other dimensions keep the example's sizes.

    Raises:
        InvalidArgument: the module cannot be exported (the message says why and
            names the factory alternative), or ``dim`` is not an int.
    """
    from torch.export import Dim

    dim = checked_batch_dim(dim)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)

    def dynamic_of(t: object) -> dict[int, Any] | None:
        axis = _batch_axis(t, dim) if isinstance(t, torch.Tensor) else None
        return None if axis is None else {axis: Dim.DYNAMIC}

    dynamic = tree_map(dynamic_of, example_inputs)
    if isinstance(module, FunctionModule):
        dynamic = (dynamic,)  # its forward takes them all as one *args parameter
    try:
        with _EXPORTING:
            program = torch.export.export(module, example_inputs, dynamic_shapes=dynamic)
    except Exception as exc:
        raise InvalidArgument(
            f"torch.export could not export {type(module).__name__}: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:400]}. Make the model exportable, or install "
            "it on the workers and start them with --allow-factory pkg.module, then "
            "load_model(name, factory='pkg.module:function', kwargs={...})"
        ) from None
    # The archive's sample inputs are stored with torch.save; keep them trivial.
    program.example_inputs = None
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def program_name(archive: bytes) -> str:
    """The reserved model name a function's archive is loaded under on the workers."""
    return FUNCTION_PREFIX + hashlib.sha256(archive).hexdigest()[:16]


def _signature(example_inputs: Any, dim: int) -> tuple[Any, ...]:
    """What an export depends on in the inputs: structure, dtypes, shapes but ``dim``."""
    leaves = tuple(
        (leaf.dtype, tuple(s for i, s in enumerate(leaf.shape) if i != _batch_axis(leaf, dim)))
        if isinstance(leaf, torch.Tensor)
        else (type(leaf).__name__, repr(leaf)[:64])
        for leaf in tree_leaves(example_inputs)
    )
    return (str(tree_structure(example_inputs)), dim, *leaves)


def _weights_version(module: nn.Module) -> tuple[Any, ...]:
    """Changes whenever a parameter or buffer is replaced, modified in place, or given
    new storage (``p.data = ...`` moves no version counter, only the data pointer)."""
    tensors = [*module.parameters(), *module.buffers()]
    return (module.training, *((id(t), t._version, t.data_ptr()) for t in tensors))


# A module's own tensors, children and mode: in the key already (_weights_version) or
# walked as modules themselves (_structure).
_WALKED = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _structure(module: nn.Module) -> tuple[Any, ...]:
    """Changes whenever what the module computes may change with no weight changing: a
    submodule added, removed or replaced (``m[1] = nn.ReLU()``), a plain attribute
    set (``self.scale = 3.0``, ``Dropout.p``), a hook added or removed."""
    return tuple(
        (name, type(m), tuple((k, _fingerprint(v)) for k, v in vars(m).items() if k not in _WALKED))
        for name, m in module.named_modules(remove_duplicate=False)
    )


def _fingerprint(value: Any) -> Any:
    """A value as the key holds it: plain values themselves, containers by their items,
    tensors as the weights are, anything else by identity (a replaced object differs)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return (id(value), value._version, value.data_ptr())
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_fingerprint(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_fingerprint(v) for v in value))
    if isinstance(value, dict):  # hooks, by handle id and function
        return (type(value), tuple((k, _fingerprint(v)) for k, v in value.items()))
    return (type(value), id(value))


class ProgramCache:
    """Archives this client exported, and the workers each program is loaded on.

    Keys hold the module itself (not only its ``id``), so an id is never reused
    for another module while its entry lives; the oldest entries are dropped
    past :data:`MAX_CACHED_PROGRAMS`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._archives: dict[tuple[Any, ...], tuple[nn.Module, bytes]] = {}
        self._loaded: dict[str, frozenset[str]] = {}

    def archive(self, module: nn.Module, example_inputs: Any, dim: int = 0) -> bytes:
        """``module``'s archive, exported now only if this client has not exported it
        for these input signatures, these weights and this structure (submodules,
        plain attributes, hooks) before."""
        dim = checked_batch_dim(dim)
        key = (
            id(module),
            _signature(example_inputs, dim),
            _weights_version(module),
            _structure(module),
        )
        with self._lock:
            hit = self._archives.get(key)
        if hit is not None and hit[0] is module:
            return hit[1]
        archive = export_archive(module, example_inputs, dim)
        with self._lock:
            self._archives[key] = (module, archive)
            while len(self._archives) > MAX_CACHED_PROGRAMS:
                del self._archives[next(iter(self._archives))]
        return archive

    def loaded_on(self, name: str, worker_ids: frozenset[str]) -> bool:
        """True when program ``name`` was loaded on every one of ``worker_ids``."""
        with self._lock:
            return worker_ids <= self._loaded.get(name, frozenset())

    def mark_loaded(self, name: str, worker_ids: frozenset[str]) -> None:
        with self._lock:
            self._loaded[name] = self._loaded.get(name, frozenset()) | worker_ids

    def forget(self, name: str) -> None:
        """Program ``name`` is gone from some worker (it said NOT_FOUND): load it again."""
        with self._lock:
            self._loaded.pop(name, None)
