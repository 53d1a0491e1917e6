"""Cluster-wide model ops the leader sequences: gradient aggregation and train steps.

``all_reduce_gradients`` reduces every parameter's gradient in buckets
(<= ``bucket_bytes``, one dtype each, parameters in reverse registration order
as DDP does, since that is roughly the order backward produces them), one
all-reduce per bucket: the number of data collectives equals the number of
buckets, not of parameters. Gradients live in the model's gradient arena
(``models.GradArena``, DDP's gradient-as-bucket-view), so a bucket is reduced
in place, without a flattening copy or a copy back. A rank that has no
gradient for a parameter (it got no shard) contributes zeros; a parameter with
no gradient on any rank keeps none. Every rank ends with bit-identical
gradients because all-reduce gives every rank the same bytes.

Like DDP's, the reduction is in place: an all_reduce_gradients that fails
part-way (a worker lost) leaves this rank's gradients undefined; compute them
again (zero_grad, forward, backward) before the next step.

Gradients left by a data-parallel backward are each rank's part of one
batch's gradient (``HostedModel.grads_are_shares``): their sum is the batch's
gradient, and "avg" is refused on them, whichever client asks, until a "sum"
(after which every rank holds the whole gradient) or a ``zero_grad``.

``step`` and ``zero_grad`` are sequenced too, so that two clients' steps (and a
step and a publish, each a new version) run in one order on every rank: ``step``
checks the model on every rank, plans the optimizer and agrees on that plan's
outcome, then clips and steps without reducing; ``zero_grad`` clears every
parameter's gradient.

``train_step`` optimises the loss it returns: the mean over the whole batch,
as one ``nn.DataParallel`` step computes it. Each rank weighs its shard's loss
by its share of the batch's rows before its backward, and the gradients are
summed: the applied gradient is the gradient of
``sum(rows_r / rows * loss_r)``, which is the full-batch mean for a mean loss,
for even and uneven shards alike. It always runs the model in train mode,
whatever mode the model is recorded in, and leaves that mode as it is. A rank
whose shard is empty runs no forward and contributes zeros. A failed step puts
back the buffers (batch norm's running statistics) it had changed on every
rank and leaves the gradients cleared there, as it clears them first.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist
from torch.nn import functional

from collectives.errors import CollectiveError, InvalidArgument, NotFound, Reason, error_for_code
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire.names import FUNCTION_PREFIX
from collectives_server.json_input import parse_json_object
from collectives_server.worker.engine import agreement
from collectives_server.worker.engine.op_context import Announcement, OpContext
from collectives_server.worker.kernels import op_failures
from collectives_server.worker.kernels.collective_ops import copy_into
from collectives_server.worker.models import modes as model_modes
from collectives_server.worker.models import versions as model_versions
from collectives_server.worker.models.execution import run_on_devices
from collectives_server.worker.models.optimizers import (
    OptimizerPlan,
    clip_gradients,
    install,
    plan_optimizer,
)
from collectives_server.worker.models.registry import GENERATOR, HostedModel

__all__ = ["LOSSES", "ModelOpResult", "run_model_op", "ModelArgs", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# By the names in collectives.wire.names.BUILTIN_LOSSES.
LOSSES = {"mse": functional.mse_loss, "cross_entropy": functional.cross_entropy}
# present, signature, has inputs, has targets, all parameters have a gradient, gradients
# are shares of a data-parallel backward, rows of the inputs (train_step).
_INFO = 7
_SHARES, _ROWS = 5, 6


@dataclass(frozen=True)
class ModelArgs:
    """The arguments of a model op (all_reduce_gradients, train_step, step, zero_grad),
    from the descriptor's payload."""

    is_train: bool
    name: str
    op: int = 0
    bucket_bytes: int = 0
    inputs: str = ""
    targets: str = ""
    loss: str = ""
    optimizer: str = ""
    hyper_json: str = ""
    max_grad_norm: float = 0.0
    reduces: bool = True  # the gradients are all-reduced (not by step, zero_grad)
    zeroes: bool = False  # zero_grad

    @classmethod
    def of(cls, desc: worker_pb2.OpDescriptor) -> ModelArgs:
        which = desc.WhichOneof("args")
        if which == "train_step":
            t = desc.train_step
            return cls(
                True, t.model, 0, t.bucket_bytes, t.inputs, t.targets, t.loss, t.optimizer,
                t.hyper_json, t.max_grad_norm,
            )  # fmt: skip
        if which == "step":
            s = desc.step
            return cls(
                False, s.model, optimizer=s.optimizer, hyper_json=s.hyper_json,
                max_grad_norm=s.max_grad_norm, reduces=False,
            )  # fmt: skip
        if which == "zero_grad":
            return cls(False, desc.zero_grad.model, reduces=False, zeroes=True)
        g = desc.gradients
        return cls(False, g.model, g.op, g.bucket_bytes)


@dataclass(frozen=True)
class ModelOpResult:
    op_id: int
    generation: int
    buckets: int
    nbytes: int
    loss: float
    rank_losses: list[float]
    latency_s: float
    steps: int = 0  # the model's optimizer steps so far (a step)
    version: int = 0  # the model's version after the op


def _buckets(params: list[torch.nn.Parameter], active: list[int], bucket_bytes: int):
    """Indices (into ``params``) per bucket: the ``active`` parameters in reverse order,
    one dtype per bucket, <= bucket_bytes (a larger parameter gets a bucket alone)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    dtype = None
    for i in reversed(active):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if current and (p.dtype != dtype or size + nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        dtype = p.dtype
    if current:
        buckets.append(current)
    return buckets


def reduce_gradients(
    ctx: OpContext, model: HostedModel, op: ReduceOp, bucket_bytes: int, mask: list[bool]
) -> tuple[int, int]:
    """Bucketed all-reduce of the gradients of the parameters ``mask`` marks (those with a
    gradient on some rank) on this rank; returns (buckets, bytes). The caller holds the
    model's lock.

    Gradients live in the model's arena (``models.GradArena``): a bucket of
    consecutive parameters is reduced in place in its slice; only a bucket whose
    parameters are not consecutive there (a parameter between them has no
    gradient anywhere) goes through a flat copy."""
    pg = ctx.groups[0].handles.data  # type: ignore[union-attr]
    arena = model.grad_arena()
    params = arena.params
    active = [i for i, m in enumerate(mask) if m]
    for i in active:
        arena.adopt(i)  # no gradient here: zeros, as the other ranks expect
    buckets = _buckets(params, active, bucket_bytes)
    native = dist.ReduceOp.AVG if op is ReduceOp.AVG else dist.ReduceOp.SUM
    opts = dist.AllreduceOptions()
    opts.reduceOp = native
    total = 0
    for bucket in buckets:
        flat = arena.flat(bucket)
        if flat is not None:
            ctx.call(lambda flat=flat: pg.allreduce([flat], opts).wait())
        else:
            views = [arena.view(i) for i in bucket]
            flat = torch.empty(
                sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device
            )
            offset = 0
            for v in views:
                copy_into(flat.narrow(0, offset, v.numel()), v.reshape(-1))
                offset += v.numel()
            ctx.call(lambda flat=flat: pg.allreduce([flat], opts).wait())
            offset = 0
            for v in views:
                copy_into(v, flat.narrow(0, offset, v.numel()).view(v.shape))
                offset += v.numel()
        total += flat.numel() * flat.element_size()
    ctx.count_data_collectives(len(buckets), len(buckets))
    return len(buckets), total


def _any_rank_has_grad(ctx: OpContext, flags: list[bool]) -> list[bool]:
    """Which parameters have a gradient on at least one rank (control group, not data)."""
    if not flags:
        return []
    mine = torch.tensor(flags, dtype=torch.uint8, device="cpu")
    control = ctx.groups[0].handles.control  # type: ignore[union-attr]
    every = ctx.call(agreement.all_gather_rows, control, mine, ctx.world_size)
    return [bool(v) for v in every.amax(0).tolist()]


def _mask(ctx: OpContext, flags: list[bool], everywhere: bool) -> list[bool]:
    """The parameters to reduce. ``everywhere``: every rank said all its parameters have
    a gradient (told in an exchange the op needed anyway), so no extra round."""
    return [True] * len(flags) if everywhere else _any_rank_has_grad(ctx, flags)


def _loss_function(ctx: OpContext, loss: str) -> Callable[..., torch.Tensor]:
    """A built-in loss by name, or the loss program loaded as ``loss`` on this rank.

    Raises:
        NotFound: the loss program is not loaded here.
        InvalidArgument: neither a built-in loss nor a loss program's name.
    """
    builtin = LOSSES.get(loss)
    if builtin is not None:
        return builtin
    if not loss.startswith(FUNCTION_PREFIX):
        raise InvalidArgument(f"loss {loss!r} is not supported")
    program = ctx.models.peek(loss)
    if program is None:
        raise NotFound(f"loss program {loss!r} is not loaded on this rank")
    return program.runnable()


def _rows(t: torch.Tensor) -> int:
    """The batch rows of a train_step input (a 0-d input is one row)."""
    return int(t.shape[0]) if t.dim() else 1


def _local_train(
    ctx: OpContext, model: HostedModel, args: ModelArgs, share: float
) -> tuple[float, int]:
    """Forward, loss and backward of this rank's shard, in train mode; the gradient is
    that of the loss weighed by ``share`` (this shard's part of the batch's rows).
    Returns the shard's (unweighed) loss and its rows; an empty shard runs nothing."""
    # peek, not get: the executor never waits on a commit fence (every rank
    # checked these names are present before this point).
    inputs = ctx.store.peek(args.inputs)
    targets = ctx.store.peek(args.targets)
    if inputs is None or targets is None:
        raise NotFound(f"tensor {args.inputs if inputs is None else args.targets!r} vanished")
    loss_fn = _loss_function(ctx, args.loss)
    for p in model.module.parameters():
        p.grad = None
    model.grads_are_shares = False
    rows = _rows(inputs)
    if rows == 0:
        return 0.0, 0
    arena = model.grad_arena()
    seeded = arena.seed()
    try:
        with torch.enable_grad(), GENERATOR.admitted():  # (dropout draws from it)
            out = run_on_devices(model, model.runnable(True), (inputs,), {})
            loss = loss_fn(out, targets)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise InvalidArgument(
                    f"the loss must return one number (a tensor of one element), got {got}"
                )
            if not loss.requires_grad:
                raise InvalidArgument("the loss does not depend on the model's output")
            (loss * share).backward()
    finally:
        arena.settle(seeded)
    if model.running_statistics:
        model.replicas_may_differ = True  # running statistics moved with this shard alone
    return float(loss.detach()), rows


# Of the op timeout: how long a rank waits for a model a peer is still sending to it.
_PENDING_WAIT_SHARE = 0.5


def run_model_op(ctx: OpContext, desc: worker_pb2.OpDescriptor, ann: Announcement):
    """Runs one model op on this rank; returns ModelOpResult or CollectiveError (same on all).

    Control rounds (besides the announcement): all_reduce_gradients exchanges one
    info row (model present, signature, "every parameter has a gradient") and then
    reduces; train_step exchanges the info row, trains locally, and agrees on the
    outcome with each rank's loss, batch and gradient flag in the same row. A rank
    holds the model's lock from before its first exchange until the op is done, so
    no backward slips in between deciding what to reduce and reducing it, and a
    read of its gradients waits until they are final."""
    ann.wait(ctx)
    args = ModelArgs.of(desc)
    model = ctx.models.peek(args.name)
    if model is None and ctx.models.pending(args.name):
        # A peer is sending it (this rank joined the generation without it: a drain's
        # successor, a spare after a crash): the op waits for it, as a forward does,
        # within half the op timeout the others wait for this rank's first exchange.
        with contextlib.suppress(CollectiveError):
            model = ctx.models.get(args.name, wait_s=_PENDING_WAIT_SHARE * ctx.timeout_s)
    lock = model.lock if model is not None else contextlib.nullcontext()
    with lock:
        return _run_model_op(ctx, model, args, desc.op_id)


@dataclass
class _Local:
    """This rank's local phase of a model op: its outcome and what it computed."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    loss: float = 0.0
    batch: int = 0
    plan: OptimizerPlan | None = None


def _info_rows(
    ctx: OpContext, model: HostedModel | None, args: ModelArgs
) -> tuple[list[list[int]], list[bool]]:
    """Every rank's info row (model present, signature, inputs, targets, all grads), and
    this rank's per-parameter "has a gradient" flags."""
    info = torch.zeros(_INFO, dtype=torch.int64, device="cpu")
    flags: list[bool] = []
    if model is not None:
        info[0] = 1
        info[1] = model.signature()
        if not args.is_train:
            flags = [p.grad is not None for _, p in model.parameters]
            info[4] = int(all(flags))
            info[_SHARES] = int(model.grads_are_shares)
    if args.is_train:
        inputs = ctx.store.peek(args.inputs)
        info[2] = int(inputs is not None)
        info[3] = int(ctx.store.peek(args.targets) is not None)
        info[_ROWS] = _rows(inputs) if inputs is not None else 0
    rows = ctx.call(agreement.all_gather_rows, ctx.control, info, ctx.world_size).tolist()
    return rows, flags


def _local_phase(ctx: OpContext, model: HostedModel, args: ModelArgs, share: float) -> _Local:
    """The optimizer plan and the local training step: the only parts that can fail
    here; every rank agrees on their outcome before gradients move."""
    local = _Local()
    try:
        if args.optimizer:
            hyper = parse_json_object(args.hyper_json, "optimizer hyperparameters")
            local.plan = plan_optimizer(model, args.optimizer, hyper)  # installed once all agreed
        if args.is_train:
            local.loss, local.batch = _local_train(ctx, model, args, share)
    except CollectiveError as exc:
        local.code, local.message = exc.code, exc.message
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        local.code = grpc.StatusCode.INVALID_ARGUMENT
        local.message = op_failures.backend_message(exc)
    return local


def _weighted_loss(extras: list[list[float]]) -> tuple[float, list[float]]:
    """The global loss (per-rank losses weighted by batch size) and every rank's loss."""
    losses = [e[0] for e in extras]
    weights = [e[1] for e in extras]
    total = sum(weights)
    if not total:
        return math.nan, losses
    return sum(loss * w for loss, w in zip(losses, weights, strict=True)) / total, losses


def _run_model_op(
    ctx: OpContext,
    model: HostedModel | None,
    args: ModelArgs,
    op_id: int,
):
    rows, flags = _info_rows(ctx, model, args)
    verdict = _decide(args, rows)
    if verdict is not None:
        return verdict
    assert model is not None
    if args.zeroes:
        model.module.zero_grad(set_to_none=True)
        model.grads_are_shares = False
        return ModelOpResult(op_id, ctx.generation, 0, 0, 0.0, [], 0.0, version=model.version)
    total_rows = sum(row[_ROWS] for row in rows)
    share = rows[ctx.rank][_ROWS] / total_rows if total_rows else 0.0
    restore = model_modes.snapshot_buffers(model.module) if args.is_train else None
    local = _local_phase(ctx, model, args, share)
    if args.is_train:
        flags = [p.grad is not None for _, p in model.parameters]
    rank_losses: list[float] = []
    global_loss = 0.0
    everywhere = all(row[4] for row in rows)
    if args.is_train or args.optimizer:
        extra = [local.loss, float(local.batch), float(all(flags))]
        failures, extras = ctx.call(
            agreement.agree_with, ctx.control, ctx.world_size, local.code, local.message, extra
        )
        if failures:
            if restore is not None:
                # A refused step leaves no running statistic changed, and the
                # gradients cleared on every rank (it clears them first).
                restore()
                for p in model.module.parameters():
                    p.grad = None
            return ctx.fail_all(failures)
        everywhere = all(e[2] for e in extras)
        if args.is_train:
            global_loss, rank_losses = _weighted_loss(extras)
    buckets = nbytes = 0
    if args.reduces:
        # train_step: every rank's gradient is already weighed by its share of the rows.
        op = ReduceOp.SUM if args.is_train else ReduceOp.from_wire(args.op)
        bucket_bytes = args.bucket_bytes or DEFAULT_BUCKET_BYTES
        mask = _mask(ctx, flags, everywhere)
        buckets, nbytes = reduce_gradients(ctx, model, op, bucket_bytes, mask)
        if op is ReduceOp.SUM:
            model.grads_are_shares = False  # every rank holds the whole gradient now
    else:
        # A step of each rank's own gradients (not reduced): the replicas may differ.
        model.replicas_may_differ = True
    clip_gradients(model, args.max_grad_norm)
    if local.plan is not None:
        install(model, local.plan).step()
        model.steps += 1
        model_versions.bump(model)
    return ModelOpResult(
        op_id, ctx.generation, buckets, nbytes, global_loss, rank_losses, 0.0,
        steps=model.steps, version=model.version,
    )  # fmt: skip


def _decide(args: ModelArgs, rows: list[list[int]]) -> CollectiveError | None:
    ranks = range(len(rows))
    absent = model_versions.presence_error(
        args.name, [bool(row[0]) for row in rows], [row[1] for row in rows]
    )
    if absent is not None:
        return absent
    if not args.is_train and args.op == ReduceOp.AVG.wire:
        sharing = [r for r in ranks if rows[r][_SHARES]]
        if sharing:
            return error_for_code(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"all_reduce_gradients({args.name!r}, op='avg') would divide the gradient by "
                f"the world size: the gradients of {args.name!r} on rank(s) "
                f"{', '.join(map(str, sharing))} come from a data_parallel backward of a loss "
                "over the whole batch, so each worker holds its shard's part and their sum is "
                "the full-batch gradient. Use op='sum' (the default). 'avg' is for per-worker "
                "mean losses, as in DDP (see docs/api.md, 'Which reduction')",
                ranks=sharing,
            )
    if args.is_train:
        for column, what in ((2, args.inputs), (3, args.targets)):
            lacking = [r for r in ranks if not rows[r][column]]
            if len(lacking) == len(rows):
                return error_for_code(
                    grpc.StatusCode.NOT_FOUND,
                    f"train_step needs tensor {what!r}, and no rank holds it "
                    "(place it with scatter or put)",
                    tensor=what,
                )
            if lacking:
                return error_for_code(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"train_step needs tensor {what!r} on every rank; missing on rank(s) "
                    f"{', '.join(map(str, lacking))} (place it with scatter or put)",
                    tensor=what,
                    ranks=lacking,
                    reason=Reason.OPERAND_MISSING,
                )
    return None
