"""Cluster-wide model ops the leader sequences: gradient aggregation and train steps.

``all_reduce_gradients`` flattens every parameter's gradient into buckets
(≤ ``bucket_bytes``, one dtype each, parameters in reverse registration order
as DDP does, since that is roughly the order backward produces them), issues
one all-reduce per bucket and copies the result back: the number of data
collectives equals the number of buckets, not of parameters. A rank that has
no gradient for a parameter (it got no shard) contributes zeros; a parameter
with no gradient on any rank keeps none. Every rank ends with bit-identical
gradients because all-reduce gives every rank the same bytes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch
import torch.distributed as dist
from torch.nn import functional

from collectives.errors import CollectiveError, InvalidArgument, error_for_code
from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives_server.worker import agreement
from collectives_server.worker.models import HostedModel, make_optimizer

if TYPE_CHECKING:
    from collectives_server.worker.runtime import GenerationRuntime

__all__ = ["ModelOpResult", "run_model_op", "DEFAULT_BUCKET_BYTES", "MODEL_KINDS"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
MODEL_KINDS = ("all_reduce_gradients", "train_step")
_LOSSES = {"mse": functional.mse_loss, "cross_entropy": functional.cross_entropy}
_INFO = 6  # present, signature, has inputs, has targets, batch, reserved


@dataclass(frozen=True)
class ModelOpResult:
    op_id: int
    generation: int
    buckets: int
    nbytes: int
    loss: float
    rank_losses: list[float]
    latency_s: float


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket: reverse order, one dtype per bucket, ≤ bucket_bytes."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    dtype = None
    for i in reversed(range(len(params))):
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
    rt: GenerationRuntime, model: HostedModel, op: ReduceOp, bucket_bytes: int
) -> tuple[int, int]:
    """Bucketed all-reduce of the model's gradients on this rank; returns (buckets, bytes)."""
    pg = rt.groups[0].handles.data  # type: ignore[union-attr]
    params = [p for _, p in model.parameters]
    mask = _any_rank_has_grad(rt, [p.grad is not None for p in params])
    active = [p for p, m in zip(params, mask, strict=True) if m]
    total = 0
    buckets = _buckets(active, bucket_bytes)
    native = dist.ReduceOp.AVG if op is ReduceOp.AVG else dist.ReduceOp.SUM
    for bucket in buckets:
        grads = [
            active[i].grad if active[i].grad is not None else torch.zeros_like(active[i])
            for i in bucket
        ]
        flat = torch.cat([g.reshape(-1) for g in grads])
        opts = dist.AllreduceOptions()
        opts.reduceOp = native
        rt.call(lambda flat=flat, opts=opts: pg.allreduce([flat], opts).wait())
        offset = 0
        for i, g in zip(bucket, grads, strict=True):
            n = g.numel()
            active[i].grad = flat[offset : offset + n].view_as(g).clone()
            offset += n
        total += flat.numel() * flat.element_size()
    rt.count_data_collectives(len(buckets), len(buckets))
    return len(buckets), total


def _any_rank_has_grad(rt: GenerationRuntime, flags: list[bool]) -> list[bool]:
    """Which parameters have a gradient on at least one rank (control group, not data)."""
    if not flags:
        return []
    mine = torch.tensor(flags, dtype=torch.uint8)
    every = torch.empty((rt.world_size, len(flags)), dtype=torch.uint8)
    control = rt.groups[0].handles.control  # type: ignore[union-attr]
    rt.call(lambda: control.allgather([[every[i] for i in range(rt.world_size)]], [mine]).wait())
    return [bool(v) for v in every.amax(0).tolist()]


def _local_train(
    rt: GenerationRuntime, model: HostedModel, desc: worker_pb2.OpDescriptor
) -> tuple[float, int]:
    inputs = rt.store.get(desc.inputs)
    targets = rt.store.get(desc.targets)
    loss_fn = _LOSSES[desc.loss]
    for p in model.module.parameters():
        p.grad = None
    with torch.enable_grad():
        out = model.module(inputs)
        loss = loss_fn(out, targets)
        loss.backward()
    return float(loss.detach()), int(inputs.shape[0]) if inputs.dim() else 1


def run_model_op(rt: GenerationRuntime, desc: worker_pb2.OpDescriptor, started: float):
    """Runs one model op on this rank; returns ModelOpResult or CollectiveError (same on all)."""
    kind = desc.kind
    model = rt.models.peek(desc.name)
    is_train = kind == "train_step"
    info = torch.zeros(_INFO, dtype=torch.int64)
    if model is not None:
        info[0] = 1
        info[1] = model.signature()
    if is_train:
        info[2] = int(rt.store.peek(desc.inputs) is not None)
        info[3] = int(rt.store.peek(desc.targets) is not None)
    out = torch.empty((rt.world_size, _INFO), dtype=torch.int64)
    control = rt.groups[0].handles.control  # type: ignore[union-attr]
    rt.call(lambda: control.allgather([[out[i] for i in range(rt.world_size)]], [info]).wait())
    rows = out.tolist()
    verdict = _decide(desc, rows)
    if verdict is not None:
        return verdict

    # Local phase; every rank agrees on its outcome before gradients move.
    code, message = grpc.StatusCode.OK, ""
    loss_value, batch = 0.0, 0
    optimizer_hyper = None
    candidate = None
    try:
        if desc.optimizer:
            optimizer_hyper = json.loads(desc.hyper_json or "{}")
            if not isinstance(optimizer_hyper, dict):
                raise InvalidArgument("optimizer hyperparameters must be a JSON object")
            if (
                model.optimizer is None
                or model.optimizer_kind != desc.optimizer
                or model.optimizer_hyper != optimizer_hyper
            ):
                candidate = make_optimizer(model, desc.optimizer, optimizer_hyper)
            else:
                candidate = model.optimizer
        if is_train:
            with model.lock:
                loss_value, batch = _local_train(rt, model, desc)
    except CollectiveError as exc:
        code, message = exc.code, exc.message
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        code, message = grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}"
    failures = rt.call(lambda: agreement.agree(control, rt.world_size, code, message))
    if failures:
        return rt.fail_all(failures)

    op = ReduceOp.from_wire(desc.op)
    if is_train:
        op = ReduceOp.AVG
    bucket_bytes = desc.bucket_bytes or DEFAULT_BUCKET_BYTES
    with model.lock:
        buckets, nbytes = reduce_gradients(rt, model, op, bucket_bytes)
        if desc.optimizer:
            if candidate is not model.optimizer:
                model.optimizer = candidate
                model.optimizer_kind = desc.optimizer
                model.optimizer_hyper = optimizer_hyper or {}
            model.optimizer.step()
            model.steps += 1

    rank_losses: list[float] = []
    global_loss = 0.0
    if is_train:  # every rank takes this branch or none: the kind is in the descriptor
        losses = torch.tensor([loss_value, float(batch)], dtype=torch.float64)
        gathered = torch.empty((rt.world_size, 2), dtype=torch.float64)
        rt.call(
            lambda: control.allgather(
                [[gathered[i] for i in range(rt.world_size)]], [losses]
            ).wait()
        )
        rank_losses = [float(v) for v in gathered[:, 0].tolist()]
        weights = gathered[:, 1]
        total_weight = float(weights.sum())
        global_loss = (
            float((gathered[:, 0] * weights).sum() / total_weight) if total_weight else math.nan
        )
    return ModelOpResult(
        desc.op_id,
        rt.generation,
        buckets,
        nbytes,
        global_loss,
        rank_losses,
        time.perf_counter() - started,
    )


def _decide(desc: worker_pb2.OpDescriptor, rows: list[list[int]]) -> CollectiveError | None:
    ranks = range(len(rows))
    missing = [r for r in ranks if not rows[r][0]]
    if len(missing) == len(rows):
        return error_for_code(
            grpc.StatusCode.NOT_FOUND, f"model {desc.name!r} is not loaded on any rank"
        )
    if missing:
        return error_for_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model {desc.name!r} is missing on rank(s) {', '.join(map(str, missing))}; "
            "load_model it again so every worker has it",
        )
    if len({rows[r][1] for r in ranks}) > 1:
        return error_for_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model {desc.name!r} has different parameters on different ranks; reload it",
        )
    if desc.kind == "train_step":
        for column, what in ((2, desc.inputs), (3, desc.targets)):
            lacking = [r for r in ranks if not rows[r][column]]
            if lacking:
                return error_for_code(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"train_step needs tensor {what!r} on every rank; missing on rank(s) "
                    f"{', '.join(map(str, lacking))} (place it with scatter or put)",
                )
    return None
