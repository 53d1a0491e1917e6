"""A generation's first step: every rank serves the newest version of every model.

A worker that joins a later generation has no models; a survivor of a failed
publish might (in a narrow window) have missed a commit its peers made. Before
a rank reports itself joined, every rank of the new generation exchanges its
model inventory (name, version, signature, how to build it, its entries) and,
for each model some rank lacks or holds at an older version, the lowest rank
holding the newest version sends it to the others over the process group (a
rank holding another load of the name is left to that load: see
:func:`plan_sync`):

  1. an exported model's checked archive, to ranks that lack the model (a
     factory model travels as its factory's name);
  2. the weights, broadcast in buckets (``coalesced_buckets``);
  3. its optimizer, when the source has one: kind, hyperparameters, param groups
     and per-parameter state (momentum buffers, Adam's moments and step counts),
     the state broadcast like the weights. Every rank of a data-parallel model
     steps with the same gradients, so the source's optimizer is every rank's: a
     newcomer (a drain's successor, a spare after a crash) steps on from it
     instead of from a fresh optimizer, and the replicas stay the same.

Only then does each rank work alone: a rank that held the model at an older
version commits the weights at once (``model_versions.commit``); a rank that
must build it does so in a background thread, because checking and loading an
archive (in the load sandbox) can take longer than peers may wait in a
collective. Until it is hosted, the model is *expected* there: a forward on it
waits for it (within its deadline), and a publish is refused with UNAVAILABLE,
which the SDK retries. A model still being built when the next generation
forms is waited for before this rank tells its inventory (within half the op
timeout): two drains in a row may leave that rank its only other holder. The
archive is checked again by the receiver as any upload is (nothing in it is
ever unpickled); a factory must be allowed there.

In a generation a drain sealed, the exchange (steps 1-3) runs while the handoff
copies the drained rank's tensors, and the hosting once it ended
(:func:`receive_models` returns that part): a successor's model then takes the
drained rank's gradients, installed by then.

The client sends nothing: a new worker's models come from a peer. A rank that
cannot host a model (its factory is not allowed there, its quota is full) logs
why and stays without it: a later op on the model names that rank. A broken
group here breaks the generation, like any op.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist

from collectives.reduce_ops import ReduceOp
from collectives.wire.batching import Batching
from collectives.wire.dtypes import from_wire, to_wire
from collectives.wire.op_specs import OpKind, spec
from collectives_server.worker.engine import agreement
from collectives_server.worker.engine.handlers import coalesced_buckets
from collectives_server.worker.engine.op_context import GroupBroken, OpContext
from collectives_server.worker.engine.validation import Plan
from collectives_server.worker.kernels import collective_ops, op_failures
from collectives_server.worker.models import optimizers
from collectives_server.worker.models import versions as model_versions
from collectives_server.worker.models.archive.upload import ModelUploads
from collectives_server.worker.models.built_ahead import ModulesBuiltAhead
from collectives_server.worker.models.registry import (
    HostedModel,
    ModelDefinition,
    build_from_factory,
)

__all__ = ["HeldModel", "SyncPlan", "plan_sync", "receive_models", "sync_models"]

log = logging.getLogger(__name__)

# Of the op timeout: how long the exchange waits for models still being built here.
_ARRIVALS_WAIT_SHARE = 0.5


@dataclass(frozen=True)
class HeldModel:
    """One rank's copy of one model, as the inventory tells it."""

    version: int
    signature: int
    factory: str
    kwargs_json: str
    archive_bytes: int
    entries: list[tuple[str, int, list[int]]]  # key, wire dtype, shape
    # Its dynamic batching as [max_rows, max_delay_ms]; None: none.
    batching: list[float] | None = None
    # Its recorded mode (ModelInfo.training); None: the module's own.
    training: bool | None = None
    # Its optimizer (see _optimizer_inventory); None: it has none.
    optimizer: dict | None = None
    # The load_model call it came from (HostedModel.load_id).
    load_id: str = ""

    @classmethod
    def of(cls, told: dict) -> HeldModel:
        """A peer's inventory entry; keys this release does not know (a newer peer's)
        are left out, so that a rolling upgrade's mixed generation can exchange."""
        return cls(**{k: v for k, v in told.items() if k in _HELD_FIELDS})

    def batching_policy(self) -> Batching | None:
        if self.batching is None:
            return None
        max_rows, max_delay_ms = self.batching
        return Batching(max_rows=int(max_rows), max_delay_ms=float(max_delay_ms))


_HELD_FIELDS = frozenset(f.name for f in fields(HeldModel))


@dataclass(frozen=True)
class SyncPlan:
    """What one model's exchange sends: from ``source`` (the lowest rank holding its
    newest version) to the ranks ``behind``, of which ``rebuild`` lack the model."""

    name: str
    source: int
    behind: list[int]
    rebuild: list[int]


def plan_sync(everyone: list[dict[str, HeldModel]]) -> list[SyncPlan]:
    """Each model's exchange, from every rank's inventory (by rank), by name.

    A rank behind lacks the model, or holds the same load of it (same signature) at
    an older version. A rank holding another load of the name is left as it is:
    loads are not in the op order, so two ranks' loads cannot say which is newer (a
    ``load_model`` on its way to the ranks while a drain seals a generation), and
    the load still on its way, or the client's next one, brings every rank to one.
    Sequenced ops refuse a model held as different loads meanwhile."""
    plans = []
    for name in sorted({n for inventory in everyone for n in inventory}):
        holders = {r: inv[name] for r, inv in enumerate(everyone) if name in inv}
        newest = max(h.version for h in holders.values())
        source = min(r for r, h in holders.items() if h.version == newest)
        signature = holders[source].signature
        rebuild = [r for r in range(len(everyone)) if r not in holders]
        stale = [r for r, h in holders.items() if h.signature == signature and h.version != newest]
        if rebuild or stale:
            plans.append(SyncPlan(name, source, sorted(rebuild + stale), rebuild))
    return plans


def sync_models(
    ctx: OpContext,
    uploads: ModelUploads,
    gradients: dict[str, dict[str, torch.Tensor]] | None = None,
) -> int:
    """Brings every rank to the newest version of every model; returns how many models
    this rank is receiving (hosted now, or being built in the background).
    ``gradients``: a drain's successor's, by model and parameter (the drained rank's
    own), set on each model as it arrives (and taken out of the mapping)."""
    return receive_models(ctx, uploads)(gradients)


def receive_models(
    ctx: OpContext, uploads: ModelUploads, built_ahead: ModulesBuiltAhead | None = None
) -> Callable[[dict[str, dict[str, torch.Tensor]] | None], int]:
    """The collective part of :func:`sync_models`, run by every rank together: what
    each rank is behind on, received. Returns the rank's own part, to call later
    (a gated generation: once its drain's handoff ended): hosting what arrived, with
    the successor's gradients as they are then, each module taken from ``built_ahead``
    where it holds one of the same definition; it returns how many models."""
    # A model an earlier generation's exchange sent here and that is still being built
    # is in no inventory until hosted: were this rank its only other holder (two drains
    # in a row), the new generation would go on without it. So the inventory waits for
    # it, within a share of the time the peers wait here.
    arriving = ctx.models.await_arrivals(_ARRIVALS_WAIT_SHARE * ctx.timeout_s)
    if arriving:
        log.warning(
            "models %s are still being built here from an earlier exchange; this "
            "generation's exchange goes on without them on this rank",
            arriving,
        )
    everyone = [
        {name: HeldModel.of(held) for name, held in inventory.items()}
        for inventory in _all_gather_json(ctx, _inventory(ctx))
    ]
    arrivals: list[_Arrival] = []
    for plan in plan_sync(everyone):
        name, source, behind, rebuild = plan.name, plan.source, plan.behind, plan.rebuild
        src = everyone[source][name]
        newest = src.version
        archive = None
        if src.archive_bytes and rebuild:
            archive = _broadcast_archive(ctx, name, src, source)
        weights = _broadcast_weights(ctx, name, src, source)
        optimizer = _broadcast_optimizer(ctx, name, src, source) if src.optimizer else None
        if ctx.rank in behind:
            arrivals.append(
                _Arrival(name, src, newest, weights, archive, ctx.rank in rebuild, optimizer)
            )

    def host(gradients: dict[str, dict[str, torch.Tensor]] | None) -> int:
        for arrival in arrivals:
            if gradients:
                arrival.gradients = gradients.pop(arrival.name, {})
            if arrival.rebuild:
                _build(ctx, uploads, arrival, built_ahead)
            else:
                _commit(ctx.models.peek(arrival.name), arrival)
        if built_ahead is not None:
            built_ahead.clear()  # (what was built for models that did not come)
        return len(arrivals)

    return host


@dataclass
class _Arrival:
    """A model this rank is behind on, as received: its weights (and archive)."""

    name: str
    src: HeldModel
    version: int
    weights: dict[str, torch.Tensor]
    archive: torch.Tensor | None
    rebuild: bool
    # The source's optimizer state tensors by key (_optimizer_inventory); None: none.
    optimizer: dict[str, torch.Tensor] | None = None
    # A drain's successor: the drained rank's gradients of this model, by parameter.
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)


def _inventory(ctx: OpContext) -> dict[str, dict]:
    out = {}
    for model in ctx.models.all():
        with model.lock:
            d = model.definition
            archive = (
                d.archive.stat().st_size if d.archive is not None and d.archive.exists() else 0
            )
            out[model.name] = {
                "version": model.version,
                "signature": model.signature(),
                "factory": d.factory,
                "kwargs_json": d.kwargs_json,
                "archive_bytes": archive,
                "entries": [
                    (k, to_wire(t.dtype), list(t.shape))
                    for k, t in model.module.state_dict().items()
                ],
                "batching": None
                if model.batcher is None
                else [model.batcher.policy.max_rows, model.batcher.policy.max_delay_ms],
                "training": model.training,
                "optimizer": _optimizer_inventory(model),
                "load_id": model.load_id,
            }
    return out


def _optimizer_inventory(model: HostedModel) -> dict | None:
    """The model's optimizer as the inventory tells it (the caller holds its lock):
    kind, hyperparameters, param groups, the state's non-tensor values, and the
    state tensors' keys (``"<param index>/<name>"``), dtypes and shapes."""
    optimizer = model.optimizer
    if optimizer is None:
        return None
    state = optimizer.state_dict()
    entries, scalars = [], {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                entries.append((f"{index}/{key}", to_wire(value.dtype), list(value.shape)))
            else:
                scalars[f"{index}/{key}"] = value
    return {
        "kind": model.optimizer_kind,
        "hyper": model.optimizer_hyper,
        "groups": state["param_groups"],
        "scalars": scalars,
        "entries": entries,
    }


def _optimizer_tensors(model: HostedModel) -> dict[str, torch.Tensor]:
    state = model.optimizer.state_dict()["state"] if model.optimizer is not None else {}
    return {
        f"{index}/{key}": value
        for index, per_param in state.items()
        for key, value in per_param.items()
        if torch.is_tensor(value)
    }


def _all_gather_json(ctx: OpContext, value: object) -> list:
    return agreement.all_gather_json(ctx.call, ctx.control, ctx.world_size, value)


def _broadcast_archive(ctx: OpContext, name: str, src: HeldModel, source: int) -> torch.Tensor:
    """The source's archive bytes, on every rank: a CPU tensor, so it travels on the
    control group (gloo) whatever the data group is (NCCL takes device tensors only;
    the archive is read from and written to files on the host anyway)."""
    t = torch.zeros(src.archive_bytes, dtype=torch.uint8, device="cpu")
    if ctx.rank == source:
        model = ctx.models.peek(name)
        path = model.definition.archive if model is not None else None
        data = path.read_bytes() if path is not None else b""
        if len(data) == src.archive_bytes:  # else zeros: the receivers' check refuses them
            t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    world = ctx.groups[0].handles
    assert world is not None
    opts = dist.BroadcastOptions()
    opts.rootRank = source
    ctx.call(lambda: world.control.broadcast([t], opts).wait())
    return t


def _broadcast_weights(
    ctx: OpContext, name: str, src: HeldModel, source: int
) -> dict[str, torch.Tensor]:
    """The source's weights, on every rank (the source's own: its live tensors)."""
    return _broadcast_tensors(ctx, name, src.entries, source, lambda held: held.module.state_dict())


def _broadcast_optimizer(
    ctx: OpContext, name: str, src: HeldModel, source: int
) -> dict[str, torch.Tensor]:
    """The source's optimizer state tensors, on every rank."""
    assert src.optimizer is not None
    return _broadcast_tensors(ctx, name, src.optimizer["entries"], source, _optimizer_tensors)


def _broadcast_tensors(
    ctx: OpContext,
    name: str,
    listed: list,
    source: int,
    read: Callable[[HostedModel], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The tensors ``listed`` (key, wire dtype, shape) of the source's model, as
    ``read`` finds them there, on every rank."""
    entries = [model_versions.Entry(k, from_wire(d), tuple(s)) for k, d, s in listed]
    operands: list[torch.Tensor | None] = [None] * len(entries)
    held = ctx.models.peek(name) if ctx.rank == source else None
    if held is not None:
        held.lock.acquire()  # no step may change the weights while they are sent
    try:
        if held is not None:
            state = read(held)
            operands = [state[e.key].detach() for e in entries]
        world = ctx.groups[0].handles
        assert world is not None
        bucketing = coalesced_buckets.Bucketing(
            pg=world.data,
            operands=operands,
            plans=[Plan(e.dtype, e.shape) for e in entries],
            size=ctx.world_size,
            index=ctx.rank,
            root_index=source,
            device=ctx.device,
            alloc=collective_ops.fresh,
        )
        try:
            got, count = coalesced_buckets.move(bucketing, spec(OpKind.BROADCAST), ReduceOp.SUM)
        except Exception as exc:
            raise GroupBroken(op_failures.backend_message(exc)) from exc
        ctx.count_data_collectives(count)
    finally:
        if held is not None:
            held.lock.release()
    return {e.key: t for e, t in zip(entries, got, strict=True) if t is not None}


def _commit(held: HostedModel | None, arrival: _Arrival) -> bool:
    """Makes the received weights live at the source's version; False (logged) if not."""
    if held is None:
        log.error("model %r vanished on this rank before its weights arrived", arrival.name)
        return False
    try:
        with held.lock:  # no step between the weights and the optimizer state
            staged = model_versions.prepare(held, arrival.weights)
            model_versions.commit(held, staged, arrival.version)
            if arrival.optimizer is not None:
                _install_optimizer(held, arrival)
            _set_rank_state(held, arrival.gradients)
    except Exception as exc:
        log.error("cannot take model %r at version %d: %s", arrival.name, arrival.version, exc)
        return False
    log.info("received model %r at version %d from a peer", arrival.name, arrival.version)
    return True


def _set_rank_state(held: HostedModel, gradients: dict[str, torch.Tensor]) -> None:
    """The drained rank's own state as this model's (the caller holds its lock): its
    parameters' gradients, and its buffers (running statistics), each where the
    shape and dtype match; the gradient arena adopts the gradients at its next use."""
    for key, param in held.parameters:
        grad = gradients.get(key)
        if grad is not None and grad.shape == param.shape and grad.dtype == param.dtype:
            param.grad = grad.to(param.device)
    with torch.no_grad():
        for key, buffer in held.module.named_buffers():
            value = gradients.get(key)
            if value is not None and value.shape == buffer.shape and value.dtype == buffer.dtype:
                buffer.copy_(value)


def _install_optimizer(held: HostedModel, arrival: _Arrival) -> None:
    """The source's optimizer, with its state, as this model's (the caller holds its lock)."""
    spec = arrival.src.optimizer
    assert spec is not None and arrival.optimizer is not None
    optimizer = optimizers.make_optimizer(held, spec["kind"], spec["hyper"])
    state: dict[int, dict] = {}
    for key, value in [*arrival.optimizer.items(), *spec["scalars"].items()]:
        index, _, field_name = key.partition("/")
        state.setdefault(int(index), {})[field_name] = value
    optimizer.load_state_dict({"state": state, "param_groups": spec["groups"]})
    plan = optimizers.OptimizerPlan(spec["kind"], dict(spec["hyper"]), optimizer, held.optimizer)
    optimizers.install(held, plan)


def _build(
    ctx: OpContext,
    uploads: ModelUploads,
    arrival: _Arrival,
    built_ahead: ModulesBuiltAhead | None,
) -> None:
    """Hosts ``arrival``: at once with a module built ahead, else built in a background
    thread (the model expected meanwhile)."""
    models = ctx.models
    expected = models.expect(arrival.name)
    replacing = models.peek(arrival.name)  # a different model under the same name, or None
    if expected is None and replacing is None:
        return  # already on its way (an earlier generation's sync is building it)
    src = arrival.src
    ready = (
        built_ahead.take(src.factory, src.kwargs_json, arrival.archive)
        if built_ahead is not None and (src.factory or arrival.archive is not None)
        else None
    )

    def build() -> None:
        archive: Path | None = None
        try:
            if ready is not None:
                module, archive = ready.module, ready.archive
            elif src.factory:
                module = build_from_factory(
                    src.factory,
                    src.kwargs_json,
                    models.allowed_factories,
                    max_bytes=uploads.config.max_bytes,
                )
            elif arrival.archive is not None:
                module, archive = uploads.load_peer_archive(arrival.archive)
            else:
                raise ValueError("its source holds neither a factory nor an archive for it")
            still_wanted = (
                models.is_expected(arrival.name, expected)
                if expected is not None
                else models.peek(arrival.name) is replacing
            )
            if not still_wanted:  # a client loaded it meanwhile: theirs wins
                if archive is not None:
                    archive.unlink(missing_ok=True)
                return
            definition = ModelDefinition(src.factory, src.kwargs_json, archive)
            hosted = models.add(
                arrival.name,
                module,
                src.factory or "export",
                definition,
                batching=src.batching_policy(),
                training=src.training,
                load_id=src.load_id,
            )
            _commit(hosted, arrival)
        except Exception as exc:
            log.error("cannot host model %r sent by a peer: %s", arrival.name, exc)
        finally:
            if expected is not None:
                models.give_up(arrival.name, expected)  # a no-op once hosted

    if ready is not None:
        build()
        log.info("hosted model %r with the module built ahead", arrival.name)
        return
    threading.Thread(target=build, name=f"model-sync-{arrival.name}", daemon=True).start()
