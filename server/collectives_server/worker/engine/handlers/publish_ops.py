"""The handler of ``publish``: a new model version, sent once, committed everywhere or nowhere.

The client put the new weights once, on the leader, under ``args.prefix``; the
leader's descriptor lists every entry (key, dtype, shape). On every rank, after
the announcement:

  1. the local checks, under the model's lock: the keys, shapes and dtypes
     against the model (``model_versions.check_entries``), the leader's uploads
     still there, no retained graph of an older version (a third resident
     version), and the staged bytes reserved against the store's quota. One
     agreement carries every rank's outcome, model signature and version: a
     model missing or different anywhere, or any local failure, fails the op on
     every rank before any data moves;
  2. the data: one broadcast per bucket from the leader (``coalesced_buckets``:
     the same buckets as a coalesced broadcast), received into fresh tensors
     beside the live weights, then cast and placed on the model's device;
  3. a second agreement on every rank's outcome, and only then the commit
     (``model_versions.commit``) at version max(every rank's version) + 1. The
     weights it replaces are kept for the next publish to land in: on the
     others, as its broadcast's receive buffers; on the leader, whose new
     weights are the uploads themselves, in the puts' pool the next uploads
     are received into (``ReplacedMemory``).

A failed op, or a broken group, drops the staged tensors: every rank keeps
serving the version it had. The leader removes the uploads whatever happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from collectives.errors import CollectiveError, Reason, error_for_code
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire.dtypes import from_wire
from collectives.wire.op_specs import OpKind, spec
from collectives_server.worker.data.store import Reservation
from collectives_server.worker.engine import agreement
from collectives_server.worker.engine.handlers import coalesced_buckets
from collectives_server.worker.engine.op_context import Announcement, GroupBroken, OpContext
from collectives_server.worker.engine.validation import Plan
from collectives_server.worker.kernels import op_failures
from collectives_server.worker.models import versions as model_versions
from collectives_server.worker.models.registry import HostedModel
from collectives_server.worker.models.versions import Entry

__all__ = ["PublishResult", "run_publish"]

_HALF = 1 << 28  # a 56-bit signature travels as two float64-exact halves


@dataclass(frozen=True)
class PublishResult:
    op_id: int
    generation: int
    version: int
    tensors: int
    nbytes: int
    latency_s: float


@dataclass
class _Local:
    """This rank's part: its outcome so far, and what it holds for the op."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    reason: str | None = None
    uploads: list[torch.Tensor | None] | None = None
    reservation: Reservation | None = None

    def fail(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, CollectiveError):
            self.code, self.message, self.reason = exc.code, exc.message, exc.reason
        else:
            self.code, self.message = op_failures.local_failure(exc, what)


def run_publish(
    ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement
) -> PublishResult | CollectiveError:
    ann.wait(ctx)
    args = desc.publish
    entries = [Entry(h.name, from_wire(h.dtype), tuple(h.shape)) for h in args.entries]
    model = ctx.models.peek(args.model)
    local = _Local()
    try:
        return _publish(ctx, desc, model, entries, local)
    finally:
        if local.reservation is not None:
            local.reservation.release()
        if ctx.rank == args.root:
            ctx.store.delete_prefix(args.prefix)


def _publish(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    model: HostedModel | None,
    entries: list[Entry],
    local: _Local,
) -> PublishResult | CollectiveError:
    args = desc.publish
    version = _check(ctx, args, model, entries, local)
    extra = _info(model, version)
    failures, rows = ctx.call(
        lambda: agreement.agree_with(
            ctx.control, ctx.world_size, local.code, local.message, extra, local.reason
        )
    )
    verdict = ctx.fail_all(failures) if failures else _decide(args.model, rows)
    if verdict is not None:
        return verdict
    assert model is not None
    new_version = int(max(row[3] for row in rows)) + 1
    staged = _receive(ctx, desc, model, entries, local)
    # The commit below is the model's, not the store's: agreement first, as
    # OpContext.agree_and_commit does for tensors.
    error = ctx.agree(local.code, local.message, local.reason)
    if error is not None:
        return error
    with model.lock:
        old_version = model.version
        replaced = model_versions.commit(model, staged, new_version)
        retained = any(g.version == old_version for g in model.graphs.values())
        if ctx.rank != args.root and not retained:
            model_versions.keep_for_reuse(model, replaced, ctx.store)
    if ctx.rank == args.root and not retained:
        # The root's new weights are the client's uploads (bulk puts): the next
        # publish's uploads land in the weights these replaced, through the puts'
        # pool, which keeps each only if nothing else still holds it.
        while replaced:
            old = replaced.pop()
            ctx.replaced.offer(old)
            del old
    nbytes = sum(e.nbytes for e in entries)
    return PublishResult(desc.op_id, ctx.generation, new_version, len(entries), nbytes, 0.0)


def _check(
    ctx: OpContext,
    args: worker_pb2.PublishArgs,
    model: HostedModel | None,
    entries: list[Entry],
    local: _Local,
) -> int:
    """Phase 1 on this rank; returns its model version (0: no model)."""
    if model is None:
        if ctx.models.pending(args.model):
            local.code = grpc.StatusCode.UNAVAILABLE
            local.message = (
                f"model {args.model!r} is still arriving from a peer (this rank joined the "
                "generation recently); retry"
            )
        return 0
    try:
        ctx.models.expire_graphs()
        with model.lock:
            problem = model_versions.check_entries(model, entries, args.strict, args.cast)
            if problem is not None:
                raise problem
            older = model_versions.older_graphs(model)
            if older:
                raise error_for_code(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"model {model.name!r}: {older} retained graph(s) still hold version "
                    f"{model.version - 1} or older, and a publish would make a third version "
                    "resident; run their backward or drop their outputs, then publish again",
                    reason=Reason.VERSIONS_RESIDENT,
                )
            version = model.version
        if ctx.rank == args.root:
            local.uploads = _uploads(ctx, args.prefix, entries)
        staged_bytes = sum(e.nbytes for e in entries)
        local.reservation = ctx.store.reserve(f"model {model.name} (staged)", staged_bytes, "model")
        return version
    except Exception as exc:  # local to this rank: the agreement fails the op everywhere
        local.fail(exc, "publish")
        return model.version


def _uploads(ctx: OpContext, prefix: str, entries: list[Entry]) -> list[torch.Tensor | None]:
    found = []
    for e in entries:
        t = ctx.store.peek(prefix + e.key)
        if t is None or t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise error_for_code(
                grpc.StatusCode.NOT_FOUND,
                f"the uploaded entry {e.key!r} is gone from the leader (expired or deleted); "
                "publish again",
            )
        found.append(t)
    return found


def _reusable(model: HostedModel) -> list[torch.Tensor]:
    with model.lock:
        return model_versions.drop_reusable(model)


def _info(model: HostedModel | None, version: int) -> list[float]:
    """present, signature (two halves), version."""
    if model is None:
        return [0.0, 0.0, 0.0, 0.0]
    sig = model.signature()
    return [1.0, float(sig // _HALF), float(sig % _HALF), float(version)]


def _decide(name: str, rows: list[list[float]]) -> CollectiveError | None:
    return model_versions.presence_error(
        name, [bool(row[0]) for row in rows], [(row[1], row[2]) for row in rows]
    )


def _receive(
    ctx: OpContext,
    desc: worker_pb2.OpDescriptor,
    model: HostedModel,
    entries: list[Entry],
    local: _Local,
) -> dict[str, torch.Tensor]:
    """Phase 2: the leader's uploads on every rank, staged in the model's dtypes and device."""
    root = desc.publish.root
    world = ctx.groups[0]
    assert world.handles is not None
    bucketing = coalesced_buckets.Bucketing(
        pg=world.handles.data,
        operands=local.uploads or [None] * len(entries),
        plans=[Plan(e.dtype, e.shape) for e in entries],
        size=ctx.world_size,
        index=ctx.rank,
        root_index=root,
        device=ctx.device,
        alloc=model_versions.reusing(_reusable(model)),
    )
    try:
        received, collectives = coalesced_buckets.move(
            bucketing, spec(OpKind.BROADCAST), ReduceOp.SUM
        )
    except Exception as exc:
        if op_failures.is_transport_failure(exc):
            raise GroupBroken(op_failures.backend_message(exc)) from exc
        local.fail(exc, "publish")
        return {}
    ctx.count_data_collectives(collectives)
    if ctx.rank == root:
        received = list(local.uploads or [])
    try:
        with model.lock:
            by_key = {e.key: t for e, t in zip(entries, received, strict=True)}
            staged = model_versions.prepare(model, by_key)
    except Exception as exc:  # a cast or a device copy failed here: the op fails everywhere
        local.fail(exc, "publish")
        return {}
    return staged
