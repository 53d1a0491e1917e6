"""Models hosted by a worker: loading, retained autograd graphs, optimizer state.

Models arrive as ``torch.export`` archives (JSON graph + raw weight bytes,
checked against an allowlist in :mod:`archive` and loaded by
:mod:`archive_upload`; nothing in them is ever unpickled)
or are built by a server-side factory that the operator allowed with
``--allow-factory pkg.module``. A forward run with autograd keeps its graph
until the client's backward, an explicit release, or ``graph_ttl_s`` — so a
client that never calls backward cannot leak a worker's memory. A drained worker
waits for the graphs it holds to end (:meth:`ModelRegistry.await_graphs_ended`)
before it hands its rank over: a graph cannot move, the gradients its backward
leaves can.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from collectives.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from collectives.wire.batching import Batching
from collectives.wire.names import validate_name
from collectives_server.json_input import parse_json_object
from collectives_server.worker.data.store import Reservation, TensorStore
from collectives_server.worker.models import modes as model_modes
from collectives_server.worker.models.batching import Batcher
from collectives_server.worker.models.device_replicas import DeviceReplicas
from collectives_server.worker.models.model_lock import ModelLock

__all__ = [
    "GENERATOR",
    "GradArena",
    "HostedModel",
    "ModelDefinition",
    "ModelRegistry",
    "RetainedGraph",
]


@dataclass
class RetainedGraph:
    outputs: dict[str, torch.Tensor]  # stored output name -> output tensor (with grad_fn)
    inputs: dict[str, torch.Tensor]  # input name -> leaf tensor whose grad the client wants
    expires_at: float
    version: int = 1  # the model version whose weights the graph holds
    # Those weights' parameters by name (the graph keeps them alive anyway).
    parameters: dict[str, nn.Parameter] = field(default_factory=dict)


def _zero(t: torch.Tensor) -> None:
    """Zeroes ``t`` (one plain memset on contiguous CPU memory: no OpenMP threads)."""
    if t.device.type == "cpu" and t.is_contiguous():
        nbytes = t.numel() * t.element_size()
        if nbytes:
            ctypes.memset(t.data_ptr(), 0, nbytes)
    else:
        t.zero_()


class GradArena:
    """One model's gradients in flat buffers, one per (dtype, device), parameters in
    reverse registration order (DDP's bucket order), ``.grad`` being views into them.

    This is DDP's ``gradient_as_bucket_view``: backward accumulates straight into
    the buffers (:meth:`seed` gives parameters without a gradient a zeroed view
    before backward; :meth:`settle` takes it away again from those backward did
    not reach, so "has a gradient" keeps its meaning), and a bucket of
    consecutive parameters is a slice of a buffer that the all-reduce reduces in
    place: no flattening copy, no copy back. A gradient that is not a view (set
    some other way) is copied into its slot by :meth:`adopt`.

    Callers hold the model's lock.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        self._slots: list[tuple[tuple[torch.dtype, torch.device], int, int]] = [
            ((p.dtype, p.device), 0, 0) for p in params
        ]
        self.position = [0] * len(params)  # place in arena order
        for pos, i in enumerate(reversed(range(len(params)))):
            p = params[i]
            key = (p.dtype, p.device)
            offset = sizes.get(key, 0)
            self._slots[i] = (key, offset, p.numel())
            sizes[key] = offset + p.numel()
            self.position[i] = pos
        self.buffers = {
            key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in sizes.items()
        }
        self._touched: set[int] = set()
        for i, p in enumerate(params):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(functools.partial(self._reached, i))

    def _reached(self, i: int, _param: torch.Tensor) -> None:
        self._touched.add(i)

    def view(self, i: int) -> torch.Tensor:
        key, offset, n = self._slots[i]
        return self.buffers[key].narrow(0, offset, n).view(self.params[i].shape)

    def holds(self, i: int) -> bool:
        """Whether parameter ``i``'s gradient is its slot in the arena."""
        g = self.params[i].grad
        if g is None:
            return False
        key, offset, _ = self._slots[i]
        buf = self.buffers[key]
        return (
            g.device == buf.device
            and g.dtype == buf.dtype
            and g.shape == self.params[i].shape
            and g.is_contiguous()
            and g.data_ptr() == buf.data_ptr() + offset * buf.element_size()
        )

    def adopt(self, i: int) -> None:
        """Makes parameter ``i``'s gradient its slot, keeping its value (None: zeros)."""
        if self.holds(i):
            return
        p = self.params[i]
        slot = self.view(i)
        if p.grad is None:
            _zero(slot)
        else:
            from collectives_server.worker.kernels.collective_ops import copy_into

            copy_into(slot, p.grad.detach())
        p.grad = slot

    def seed(self) -> list[int]:
        """Before a backward: a zeroed slot as the gradient of every parameter without one."""
        seeded = []
        for i, p in enumerate(self.params):
            if p.requires_grad and p.grad is None:
                slot = self.view(i)
                _zero(slot)
                p.grad = slot
                seeded.append(i)
        self._touched.clear()
        return seeded

    def settle(self, seeded: list[int]) -> None:
        """After the backward: parameters it did not reach have no gradient again."""
        for i in seeded:
            if i not in self._touched and self.holds(i):
                self.params[i].grad = None
        self._touched.clear()

    def flat(self, indices: list[int]) -> torch.Tensor | None:
        """The buffer slice holding these parameters' slots, if they are consecutive in
        arena order (as a bucket of consecutive parameters is); else None."""
        if not indices:
            return None
        key = self._slots[indices[0]][0]
        positions = [self.position[i] for i in indices]
        first = min(positions)
        if sorted(positions) != list(range(first, first + len(indices))):
            return None
        if any(self._slots[i][0] != key for i in indices):
            return None
        start = min(self._slots[i][1] for i in indices)
        total = sum(self._slots[i][2] for i in indices)
        return self.buffers[key].narrow(0, start, total)


@dataclass(frozen=True)
class ModelDefinition:
    """How to build the model again (a peer catching up on it, ``model_sync``)."""

    factory: str = ""
    kwargs_json: str = ""
    archive: Path | None = None  # the checked torch.export archive, kept on disk

    def discard(self) -> None:
        if self.archive is not None:
            self.archive.unlink(missing_ok=True)


def _retire(model: HostedModel) -> None:
    """A model no longer hosted: its kept archive and kept memory go."""
    model.definition.discard()
    model.reusable = []
    if model.reusable_reservation is not None:
        model.reusable_reservation.release()
        model.reusable_reservation = None


@dataclass
class HostedModel:
    name: str
    module: nn.Module
    source: str
    devices: list[torch.device]
    lock: ModelLock = field(default_factory=ModelLock)
    graphs: dict[str, RetainedGraph] = field(default_factory=dict)
    # Set by optimizers.install only (the rule for keeping its state is there).
    optimizer: torch.optim.Optimizer | None = None
    optimizer_kind: str = ""
    optimizer_hyper: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    # 1 after loading, +1 per committed publish or optimizer step (model_versions).
    version: int = 1
    # Which load_model call it came from, the same on every worker (ModelSpec.load_id).
    load_id: str = ""
    definition: ModelDefinition = field(default_factory=ModelDefinition)
    # Merges concurrent no-grad forwards (batching); None: each forward runs alone.
    batcher: Batcher | None = None
    # The previous version's memory, kept for the next publish to receive into
    # (model_versions.keep_for_reuse), and its quota reservation.
    reusable: list[torch.Tensor] = field(default_factory=list)
    reusable_reservation: Reservation | None = None
    _arena: GradArena | None = None
    # The recorded mode (ModelInfo.training): the loaded module's ``.training`` (an
    # archive's: the client module's, sent at load), what a call that names no mode
    # runs in. Changed only by set_mode, never by a call that names its own mode.
    training: bool | None = None
    # Whether the gradients held here came from a data-parallel backward of a loss
    # over the whole batch (each rank holds its shard's part; their sum is the
    # batch's gradient) and were not sum-reduced since: "avg" would divide them.
    grads_are_shares: bool = False
    # Whether this rank's weights may differ from the other ranks': an optimizer step
    # (Step) ran since the model was loaded or last published whole, on gradients no
    # rank can vouch were the same everywhere. A client places a small forward on any
    # worker only while no rank says so (ForwardResponse.replicas_may_differ).
    replicas_may_differ: bool = False
    # Whether train mode normalises over the batch (model_modes.uses_batch_statistics).
    batch_statistics: bool = field(init=False, default=False)
    # Whether train mode writes this rank's buffers (model_modes.keeps_running_statistics).
    running_statistics: bool = field(init=False, default=False)
    # The module to call per mode, and the module, parameters and buffers it was
    # built for (a publish may replace them): model_modes.for_mode's graphs.
    _runnables: dict[bool, tuple[tuple[int, ...], nn.Module]] = field(default_factory=dict)
    _switched_plain: tuple[int, bool] | None = None  # (id of module, the mode set on it)
    # The module's kept copies on each local GPU, for forwards that only read it
    # (None: one device, or not all GPUs).
    replicas: DeviceReplicas | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.training is None:
            self.training = model_modes.captured_mode(self.module)
        self.batch_statistics = model_modes.uses_batch_statistics(self.module)
        self.running_statistics = model_modes.keeps_running_statistics(self.module)
        if len(self.devices) > 1 and all(d.type == "cuda" for d in self.devices):
            self.replicas = DeviceReplicas([d.index for d in self.devices])

    def runnable(self, training: bool | None = None) -> nn.Module:
        """The module to call in ``training`` mode (None: the recorded mode). The
        recorded mode is left as it is. An exported model's graph for a mode is built
        once per set of weights (a publish may replace them) and shares them.

        Raises:
            FailedPrecondition: the exported graph cannot run in that mode.
        """
        with self.lock:
            return self._in_mode(bool(self.training if training is None else training))

    def set_mode(self, training: bool) -> None:
        """Records ``training`` as the model's mode (``set_model_mode``) once the model
        can run in it.

        Raises:
            FailedPrecondition: the exported graph cannot run in that mode.
        """
        with self.lock:
            self._in_mode(training)
            self.training = training

    def runnable_as_is(self, training: bool) -> nn.Module | None:
        """The module to call in ``training`` mode if nothing must change to have it (the
        caller holds the lock, shared or not), else None: then :meth:`runnable`."""
        return self._built_for(training)

    def _built_for(self, mode: bool) -> nn.Module | None:
        """The module already set up to run in ``mode`` (None: it must be switched or built)."""
        module = self.module
        if not model_modes.is_graph(module):
            return module if self._switched_plain == (id(module), mode) else None
        built = self._runnables.get(mode)
        if built is None:
            return None
        key, runnable = built
        if runnable is module:  # the captured graph itself holds its own weights
            return module
        return runnable if key == self._weights_key() else None

    def _weights_key(self) -> tuple[int, ...]:
        module = self.module
        return (id(module), *map(id, module.parameters()), *map(id, module.buffers()))

    def _in_mode(self, mode: bool) -> nn.Module:
        built = self._built_for(mode)
        if built is not None:
            return built
        module = self.module
        if not model_modes.is_graph(module):
            # Module.train walks every submodule: only when the mode changes.
            model_modes.for_mode(module, mode, self.name)
            self._switched_plain = (id(module), mode)
            return module
        runnable = model_modes.for_mode(module, mode, self.name)
        self._runnables[mode] = (self._weights_key(), runnable)
        return runnable

    @property
    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def grad_arena(self) -> GradArena:
        """The model's gradient arena (built on first use; the caller holds ``lock``)."""
        params = [p for _, p in self.parameters]
        arena = self._arena
        if (
            arena is None
            or len(arena.params) != len(params)
            or any(a is not b for a, b in zip(arena.params, params, strict=True))
        ):
            arena = self._arena = GradArena(params)
        return arena

    def signature(self) -> int:
        """A hash of parameter names, dtypes and shapes, and of the load that made the
        model here: equal on every rank that loaded it in one ``load_model`` (two loads
        of one name at once may reach the ranks in different orders)."""
        text = ";".join(f"{n}:{p.dtype}:{tuple(p.shape)}" for n, p in self.parameters)
        text += f";load:{self.load_id}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


# Torch's default generator is one stream for the whole process. A factory seeds it to
# build the same weights on every rank (``manual_seed``), so a build holds it alone:
# two builds at once (two clients' loads), or a forward drawing from it meanwhile
# (dropout in train mode), would draw from the factory's stream and leave weights of
# no seed. Whatever may draw from it while models serve (a forward in train mode,
# train_step) holds it shared: such draws run at once, and a build waits for them.
GENERATOR = ModelLock()


def build_from_factory(
    factory: str, kwargs_json: str, allowed: tuple[str, ...], max_bytes: int | None = None
) -> nn.Module:
    """Builds the model an allowed factory makes from JSON keyword arguments.

    The factory first runs on the meta device, where nothing is allocated: its
    arguments are refused there (``INVALID_ARGUMENT``, with the factory's own
    words), and the weights' total size is known before any memory is taken
    (``RESOURCE_EXHAUSTED`` over ``max_bytes``, the worker's --max-model-bytes).
    A build holds torch's generator alone (see ``GENERATOR``).

    Raises:
        InvalidArgument: a malformed factory name or arguments the factory refuses.
        PermissionDenied: the factory's module is not allowed on this worker.
        NotFound: no such factory.
        ResourceExhausted: the weights would exceed ``max_bytes``, or memory ran out.
    """
    module_name, _, fn_name = factory.partition(":")
    if not module_name or not fn_name:
        raise InvalidArgument(f"factory {factory!r} must look like 'pkg.module:function'")
    if not any(module_name == a or module_name.startswith(a + ".") for a in allowed):
        raise PermissionDenied(
            f"factory module {module_name!r} is not allowed on this worker; start it with "
            f"--allow-factory {module_name}"
            + (f" (allowed: {', '.join(allowed)})" if allowed else " (none allowed)")
        )
    kwargs = parse_json_object(kwargs_json, "factory kwargs")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise NotFound(f"factory {factory!r} not found on this worker: {exc}") from None
    with GENERATOR:
        return _build(factory, fn, kwargs, max_bytes)


def _build(factory: str, fn: Any, kwargs: dict[str, Any], max_bytes: int | None) -> nn.Module:
    with torch.device("meta"):
        outline = _call_factory(factory, fn, kwargs)
    nbytes = sum(t.numel() * t.element_size() for t in (*outline.parameters(), *outline.buffers()))
    del outline
    if max_bytes is not None and nbytes > max_bytes:
        raise ResourceExhausted(
            f"factory {factory!r} with these arguments builds {nbytes} bytes of weights; "
            f"this worker's --max-model-bytes is {max_bytes}"
        )
    try:
        return _call_factory(factory, fn, kwargs)
    except MemoryError:
        raise ResourceExhausted(
            f"factory {factory!r}: out of memory building {nbytes} bytes of weights"
        ) from None


def _call_factory(factory: str, fn: Any, kwargs: dict[str, Any]) -> nn.Module:
    """``fn(**kwargs)``; what the factory refuses becomes INVALID_ARGUMENT with its
    first line (torch's own messages go on with frames of C++ no client needs)."""
    try:
        module = fn(**kwargs)
    except (TypeError, ValueError, OverflowError, RuntimeError, NotImplementedError) as exc:
        if isinstance(exc, RuntimeError) and "alloc" in str(exc):
            raise ResourceExhausted(f"factory {factory!r}: {_first_line(exc)}") from None
        raise InvalidArgument(
            f"factory {factory!r} rejected its arguments: {_first_line(exc)}"
        ) from None
    if not isinstance(module, nn.Module):
        raise InvalidArgument(
            f"factory {factory!r} returned {type(module).__name__}, not a torch.nn.Module"
        )
    return module


def _first_line(exc: BaseException, limit: int = 300) -> str:
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


class ModelRegistry:
    def __init__(
        self,
        devices: list[torch.device],
        allowed_factories: tuple[str, ...] = (),
        graph_ttl_s: float = 60.0,
        quota: TensorStore | None = None,
        factory_batching: Batching | None = None,
    ) -> None:
        self.devices = devices
        self.allowed_factories = allowed_factories
        # The batching of a model built by a factory whose load names none.
        self.factory_batching = factory_batching
        self.graph_ttl_s = graph_ttl_s
        # Model weights count against the tensor store's quota: loading models must not
        # be a way around it.
        self._quota = quota
        # Per model: the reservations that together cover its weights' bytes.
        self._reservations: dict[str, list[Reservation]] = {}
        self._models: dict[str, HostedModel] = {}
        # Models a peer is sending this rank (model_sync): set once hosted or given up.
        self._pending: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        # Notified when a retained graph ends (its backward finished, it was released or
        # expired, its model went); counts the backwards running.
        self._graphs_ended = threading.Condition()
        self._backwards_running = 0

    def add(
        self,
        name: str,
        module: nn.Module,
        source: str,
        definition: ModelDefinition | None = None,
        batching: Batching | None = None,
        training: bool | None = None,
        load_id: str = "",
    ) -> HostedModel:
        """Hosts ``module`` under ``name`` (replacing any), merging its concurrent
        no-grad forwards by ``batching`` when given, with ``training`` as its recorded
        mode (None: the module's own, ``model_modes.captured_mode``), from the load
        ``load_id``.

        Raises:
            ResourceExhausted: its parameters and buffers do not fit in the quota.
        """
        validate_name(name, "model name")
        try:
            reservation = self._reserve(name, module)
        except BaseException:
            if definition is not None:
                definition.discard()
            raise
        module = module.to(self.devices[0])
        hosted = HostedModel(
            name,
            module,
            source,
            list(self.devices),
            definition=definition or ModelDefinition(),
            batcher=None if batching is None else Batcher(batching),
            training=training,
            load_id=load_id,
        )
        with self._lock:
            replaced = self._models.get(name)
            if replaced is not None:
                _retire(replaced)
            self._models[name] = hosted
            arrived = self._pending.pop(name, None)
            if arrived is not None:
                arrived.set()
            held = self._reservations.pop(name, [])
            if reservation is not None:
                # The replaced model's bytes (held) plus what this one needs beyond them.
                self._reservations[name] = [*held, reservation]
        if reservation is None:
            for r in held:
                r.release()
        if replaced is not None:
            self.graph_ended()
        return hosted

    def _reserve(self, name: str, module: nn.Module) -> Reservation | None:
        if self._quota is None:
            return None
        nbytes = sum(t.numel() * t.element_size() for t in module.parameters())
        nbytes += sum(t.numel() * t.element_size() for t in module.buffers())
        with self._lock:
            credit = sum(r.nbytes for r in self._reservations.get(name, []))
        # A model replacing one of the same name may use the bytes it frees.
        try:
            return self._quota.reserve(f"model {name}", max(nbytes - credit, 0), "model")
        except ResourceExhausted as exc:
            raise ResourceExhausted(
                f"model {name!r} needs {nbytes} bytes of weights: {exc.message}"
            ) from None

    def expect(self, name: str) -> threading.Event | None:
        """Marks ``name`` as on its way from a peer (None if already hosted or expected);
        the event is set once it is hosted (``add``) or given up (``give_up``)."""
        with self._lock:
            if name in self._models or name in self._pending:
                return None
            event = self._pending[name] = threading.Event()
            return event

    def give_up(self, name: str, event: threading.Event) -> None:
        with self._lock:
            if self._pending.get(name) is event:
                del self._pending[name]
        event.set()

    def is_expected(self, name: str, event: threading.Event) -> bool:
        with self._lock:
            return self._pending.get(name) is event

    def pending(self, name: str) -> bool:
        with self._lock:
            return name in self._pending

    def await_arrivals(self, timeout_s: float) -> list[str]:
        """Waits up to ``timeout_s`` until no model is on its way here (each hosted or
        given up); returns the names still on their way then."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                arriving = list(self._pending.values())
            if not arriving:
                return []
            if not arriving[0].wait(max(deadline - time.monotonic(), 0.0)):
                with self._lock:
                    return sorted(self._pending)

    def get(self, name: str, wait_s: float = 0.0) -> HostedModel:
        """The model; one a peer is still sending is waited for, at most ``wait_s``."""
        with self._lock:
            model = self._models.get(name)
            arriving = self._pending.get(name)
        if model is None and arriving is not None and arriving.wait(wait_s):
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
            model = self._models.pop(name, None)
            removed = model is not None
            reservations = self._reservations.pop(name, [])
        if model is not None:
            _retire(model)
            self.graph_ended()
        for reservation in reservations:
            reservation.release()
        return removed

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def all(self) -> list[HostedModel]:
        with self._lock:
            return list(self._models.values())

    def graphs_retained(self) -> int:
        return sum(len(m.graphs) for m in self.all())

    def graph_ended(self) -> None:
        """Wakes :meth:`await_graphs_ended`: a graph was released, expired or retired."""
        with self._graphs_ended:
            self._graphs_ended.notify_all()

    @contextlib.contextmanager
    def backward_running(self) -> Iterator[None]:
        """Counts a backward from taking its graph until its gradients are accumulated
        (or it failed): until then its graph has not ended."""
        with self._graphs_ended:
            self._backwards_running += 1
        try:
            yield
        finally:
            with self._graphs_ended:
                self._backwards_running -= 1
                self._graphs_ended.notify_all()

    def await_graphs_ended(self, timeout_s: float, but: frozenset[str] = frozenset()) -> set[str]:
        """Waits up to ``timeout_s`` until every forward's graph retained here, the call
        ids in ``but`` aside, has ended and no backward runs; the call ids still
        retained then (``but``'s included)."""

        def retained() -> set[str]:
            return {call_id for m in self.all() for call_id in list(m.graphs)}

        with self._graphs_ended:
            self._graphs_ended.wait_for(
                lambda: not self._backwards_running and retained() <= but, timeout_s
            )
        return retained()

    def expire_graphs(self, now: float | None = None) -> int:
        """Drops graphs whose backward never came within ``graph_ttl_s``."""
        now = time.monotonic() if now is None else now
        dropped = 0
        for model in self.all():
            if not model.graphs:  # read without the lock: a graph added meanwhile is not due
                continue
            # Never wait on a busy model (a publish, a step): the heartbeat calls
            # this, and must not miss its lease; the next call gets it. Forwards
            # holding the lock shared never touch the graphs, so they do not stop it.
            if not model.lock.try_admit():
                continue
            try:
                for call_id in [c for c, g in model.graphs.items() if g.expires_at <= now]:
                    del model.graphs[call_id]
                    dropped += 1
            finally:
                model.lock.release()
        if dropped:
            self.graph_ended()
        return dropped
