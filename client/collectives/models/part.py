"""Models on the cluster: shipping, DataParallel, gradient aggregation, optimizers.

Models are cluster-wide named resources: ``load_model`` ships a
``torch.export`` archive (batch dimension dynamic; no pickle) or names a
server-side factory, to every worker in parallel (an archive of 4 MiB or more on
two or more ranks is sent once and broadcast among the workers:
``_archive_staging``). Per-worker calls (step,
zero_grad, state) fan out to every rank; the calls that need the process group
(``all_reduce_gradients``, ``train_step``) go to the leader, which sequences
them with every other collective.

:class:`Models` is the part of ``Cluster`` that makes these calls, over a
:class:`~collectives.session.connection.Session` and the
:class:`~collectives.ops.data_plane.DataPlane` (whose shared-memory rule decides
how an archive travels). ``DataParallel`` (``data_parallel``) runs on a session
and a ``Models``: it records here which gradients it accumulated and hands back
the graphs it retained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from collectives._deadlines import time_left
from collectives._progress import progress
from collectives.errors import CollectiveError, InvalidArgument, NotFound
from collectives.models import publish as _publish
from collectives.models.archive_staging import load_staged, stage_archive
from collectives.models.placement import Placement
from collectives.models.programs import ProgramCache, as_module, example_like, program_name
from collectives.ops.data_plane import DataPlane
from collectives.reduce_ops import ReduceOp, parse_reduce_op
from collectives.session.connection import Session, server_timeout_s, without_models
from collectives.session.generation_binding import GenerationBinding, is_not_executed
from collectives.transport.calls import Call, Job
from collectives.transport.endpoints import WorkerEndpoint, is_retryable_read
from collectives.transport.model_streams import get_model_tensors, load_model_on
from collectives.v1 import worker_pb2
from collectives.wire.batching import Batching
from collectives.wire.limits import MODEL_LOAD_TIMEOUT_S
from collectives.wire.names import BUILTIN_LOSSES, FUNCTION_PREFIX, OPTIMIZERS, validate_name
from collectives.wire.pytree import from_value, tensor_leaves
from collectives.work import IssuedOp

__all__ = ["ModelInfo", "Models"]


@dataclass(frozen=True)
class ModelInfo:
    """A model loaded on the cluster, as rank 0 reports it."""

    name: str
    parameters: int
    parameter_bytes: int
    devices: list[str]
    source: str
    optimizer: str
    steps: int
    # 1 after load_model, +1 per publish (load_state_dict), step or train_step
    # with an optimizer; equal on every rank between ops.
    version: int = 1
    # The recorded mode, like nn.Module.training: the loaded module's, changed only
    # by set_model_mode; calls naming no mode run in it.
    training: bool = True
    # How concurrent no-grad forwards are merged on each worker (None: they are not),
    # and on rank 0: forwards the batcher ran, the calls and rows they served.
    batching: Batching | None = None
    batches: int = 0
    batched_calls: int = 0
    batched_rows: int = 0
    # Whether train mode normalises over the batch (batch norm): a train-mode
    # DataParallel call then gives no worker a shard of one row.
    batch_statistics: bool = False
    # Whether train mode writes each worker's buffers (running statistics of a batch
    # or instance norm): replicas then differ, and no call is placed by load.
    running_statistics: bool = False
    # Which load_model call of the name this is: a new load of the name changes it.
    load_id: str = ""


class Models:
    """The model calls of :class:`~collectives.Cluster` (see the module)."""

    def __init__(self, session: Session, data_plane: DataPlane) -> None:
        self._session = session
        self._data_plane = data_plane
        # In-flight fire-and-forget ReleaseGraph calls (see release_graph).
        self._releases: set[Any] = set()
        self._examples_lock = threading.Lock()
        # Exported archives of this client's modules and functions (exported once).
        self._programs = ProgramCache()
        # Example outputs a custom loss is traced on, per (model, inputs, targets shapes).
        self._output_examples: dict[tuple[Any, ...], Any] = {}
        # Where this client's small forwards run: workers chosen by load (data_parallel).
        self.placement = Placement()

    # --------------------------------------------------------------- loading
    def load_model(
        self,
        name: str,
        module: nn.Module | None = None,
        example_inputs: Any = None,
        *,
        factory: str | None = None,
        kwargs: dict[str, Any] | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        timeout: float | None = None,
        batching: Batching | None = None,
        batch_dim: int = 0,
    ) -> ModelInfo:
        """Loads a model on every worker, replacing one of the same name.

        Either ``module`` with ``example_inputs`` (shipped as a ``torch.export``
        archive with dimension ``batch_dim`` of every tensor input dynamic and
        the others fixed at the example's sizes: load with ``batch_dim=k`` to
        call ``data_parallel(name, dim=k)``; exported on the client, which is
        most of a small model's load time; the client exports a module once per
        input signature and set of weights; one of 4 MiB or more on two or more
        workers is sent once and broadcast among them, else streamed to each
        worker), or ``factory="pkg.module:fn"`` with JSON ``kwargs`` (workers
        must allow it with ``--allow-factory``). ``state_dict`` then publishes
        weights (:meth:`publish`, so the model is at version 2);
        ``batching=Batching(...)`` merges concurrent no-grad forwards on each
        worker (see ``collectives.Batching``). A module's model is recorded in
        the mode the module is in (``module.training``).

        Args:
            name: the model's name on the cluster.
            module: the ``nn.Module`` to export and ship. Defaults to ``None``.
            example_inputs: inputs to export ``module`` with (a tuple, or one
                input). Defaults to ``None``.
            factory: ``"pkg.module:fn"`` building the model on each worker (the
                workers must allow it with ``--allow-factory``). Defaults to ``None``.
            kwargs: JSON-serializable keyword arguments of ``factory``.
                Defaults to ``None``.
            state_dict: weights to publish after loading (tensors, never pickle;
                the model is then at version 2). Defaults to ``None``.
            timeout: seconds for the whole call (export, upload, load); None
                means ``default_timeout_s`` plus ``MODEL_LOAD_TIMEOUT_S`` (120 s,
                the default of the workers' ``--model-load-timeout-s``), the
                time a worker gives one load by default (a sandboxed trial load
                starts a Python that imports torch). Defaults to ``None``.
            batching: merge concurrent no-grad forwards of this model, from any
                clients, into one forward on each worker
                (``Batching(max_rows=256, max_delay_ms=2.0)``); forwards with
                autograd or in training mode are never merged; None: each
                forward runs alone. Defaults to ``None``.
            batch_dim: the dimension of ``module``'s inputs that
                ``data_parallel(name, dim=batch_dim)`` splits (negative counts
                from the end); a factory's model is not exported and takes any.
                Defaults to ``0``.

        A worker that refuses it before loading because it was drained (its rank
        went to a spare meanwhile) does not fail the call: the model is loaded
        again, on every rank as the cluster is then, within ``timeout``.

        Returns:
            The ``ModelInfo`` rank 0 reports.

        Raises:
            InvalidArgument: the module cannot be exported, bad arguments (a
                ``batch_dim`` that is not an int), or a ``batching`` that is not
                a ``Batching``.
            PermissionDenied: the factory is not allowed on the workers.
            CollectiveError: a worker refused the model or the call failed.
        """
        validate_name(name, "model name")
        if name.startswith(FUNCTION_PREFIX):
            raise InvalidArgument(f"model names starting {FUNCTION_PREFIX!r} are reserved")
        deadline = self._load_deadline(timeout)
        if batching is not None and not isinstance(batching, Batching):
            raise InvalidArgument(f"batching must be a collectives.Batching, got {batching!r}")
        if (module is None) == (factory is None):
            raise InvalidArgument("load_model needs either a module or a factory (not both)")
        if module is not None:
            if example_inputs is None:
                raise InvalidArgument(
                    "load_model(name, module) needs example_inputs to export the module"
                )
            archive = self._programs.archive(module, example_inputs, batch_dim)
            # The recorded mode is the module's own, whatever its graph holds.
            mode = worker_pb2.MODEL_MODE_TRAIN if module.training else worker_pb2.MODEL_MODE_EVAL
            spec = worker_pb2.ModelSpec(name=name, archive_nbytes=len(archive), mode=mode)
        else:
            try:
                kwargs_json = json.dumps(kwargs or {})
            except TypeError as exc:
                raise InvalidArgument(f"factory kwargs must be JSON-serializable: {exc}") from None
            archive = b""
            spec = worker_pb2.ModelSpec(name=name, factory=factory, factory_kwargs_json=kwargs_json)
        if batching is not None:
            spec.batching.CopyFrom(batching.to_proto())
        spec.load_id = uuid.uuid4().hex  # (one per call: ForwardResponse.load_id)
        what = f"load_model {name!r}"
        # A rank refused before loading (its worker was drained: the rank moved to a
        # successor) is loaded again where the rank is now, with every other, within
        # the deadline; the same load id, so a rank loaded twice holds one load.
        responses = self._session.retry(
            what,
            deadline,
            lambda _left: self._load_everywhere(what, spec, archive, deadline),
            is_not_executed,
        )
        info = _model_info(responses[min(responses)].model)
        if state_dict is not None:
            version = self.load_state_dict(name, state_dict, timeout=self._remaining(deadline))
            info = dataclasses.replace(info, version=version)
        return info

    def _load_everywhere(
        self, what: str, spec: worker_pb2.ModelSpec, archive: bytes, deadline: float
    ) -> dict[int, worker_pb2.LoadModelResponse]:
        """Loads ``spec`` (with ``archive``, if any) on every member; their responses."""
        endpoints = self._member_endpoints(deadline)
        staged = None
        if archive:
            use_shm = self._data_plane.shm_wanted(sorted(endpoints), deadline)
            with progress(what, len(archive), self._session.progress) as bar:
                staged = stage_archive(
                    self._session, archive, len(endpoints), use_shm, deadline, bar
                )
        if staged is None:
            with progress(what, len(archive) * len(endpoints), self._session.progress) as bar:
                responses = self._session.fan_out(
                    what,
                    {
                        rank: Job(
                            lambda e=e: load_model_on(
                                e, spec, archive, self._remaining(deadline), bar
                            )
                        )
                        for rank, e in endpoints.items()
                    },
                )
        else:
            responses = load_staged(self._session, what, spec, archive, staged, endpoints, deadline)
        return responses

    def unload_model(
        self, name: str, missing_ok: bool = False, timeout: float | None = None
    ) -> None:
        """Unloads a model from every worker.

        Args:
            name: the model.
            missing_ok: do not raise when no worker has it. Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Raises:
            InvalidArgument: a bad model name.
            NotFound: no worker had it (unless ``missing_ok``).
            CollectiveError: a worker failed or the call timed out.
        """
        validate_name(name, "model name")
        deadline = self._session.deadline(timeout)
        results = self._per_rank(
            f"unload_model {name!r}",
            deadline,
            "UnloadModel",
            worker_pb2.UnloadModelRequest(name=name, missing_ok=True),
        )
        if not missing_ok and not any(r.unloaded for r in results.values()):
            raise NotFound(f"model {name!r} is not loaded on any worker")

    def models(self, timeout: float | None = None) -> list[ModelInfo]:
        """Models loaded on the cluster (as the first member that serves them holds them:
        rank 0, unless a drain is handing rank 0 over).

        Args:
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            One ``ModelInfo`` per model.

        Raises:
            CollectiveError: rank 0 failed or the call timed out.
        """
        deadline = self._session.deadline(timeout)

        def attempt(remaining: float) -> worker_pb2.ListModelsResponse:
            # The first member of the view now that serves the models (a drained or
            # lost one is asked no more on a retry; while a drain hands a rank over,
            # the members it does not involve answer at once: they host the same).
            snapshot = self._session.formed_snapshot(time.monotonic() + remaining)
            lacking = without_models(snapshot)
            serving = [w for w in snapshot.members if w.worker_id not in lacking]
            if serving:
                endpoint = self._session.endpoint(serving[0].address)
            else:
                endpoint = self._member_endpoints(time.monotonic() + remaining)[0]
            return endpoint.unary("ListModels")(worker_pb2.ListModelsRequest(), remaining, "models")

        response = self._session.retry("models", deadline, attempt, is_retryable_read)
        return [_model_info(m) for m in response.models if not m.name.startswith(FUNCTION_PREFIX)]

    def set_model_mode(
        self, name: str, training: bool = True, timeout: float | None = None
    ) -> ModelInfo:
        """Sets the mode model ``name`` runs in on every worker, like ``nn.Module.train``.

        This is the model's recorded mode: what calls that name no mode run in,
        and what a new ``DataParallel`` starts with. In train mode dropout is on
        and batch norm normalises each shard with its own statistics (updating
        that worker's running ones, as each replica of ``nn.DataParallel``
        does); in eval mode neither. ``DataParallel.train()`` and ``eval()``
        call this.

        Args:
            name: the model.
            training: True for train mode, False for eval mode. Defaults to ``True``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            The model as rank 0 holds it now (``training`` says its mode).

        Raises:
            NotFound: the model is not loaded.
            FailedPrecondition: the model's exported graph holds a mode-dependent
                operator that cannot be switched (export it in the mode to run), or
                (train mode) a batch norm exported in eval mode whose momentum is
                None, a cumulative average its graph cannot tell from 0.0.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        validate_name(name, "model name")
        deadline = self._session.deadline(timeout)
        mode = worker_pb2.MODEL_MODE_TRAIN if training else worker_pb2.MODEL_MODE_EVAL
        request = worker_pb2.SetModelModeRequest(name=name, mode=mode)
        what = f"set_model_mode {name!r}"
        answers = self._per_rank(what, deadline, "SetModelMode", request)
        return _model_info(answers[min(answers)].model)

    # ------------------------------------------------------- gradients, steps
    def all_reduce_gradients(
        self,
        name: str,
        op: str | ReduceOp = "sum",
        bucket_bytes: int | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """All-reduces every parameter's gradient in coalesced buckets (default 25 MiB).

        One collective per bucket; afterwards every replica holds bit-identical
        gradients. A worker that got no shard contributes zeros.

        Which ``op``: after ``loss = f(dp(x)); loss.backward()`` (a loss over the
        whole gathered batch) each worker holds its shard's part of the gradient
        and the parts *add up* to the full-batch gradient: ``"sum"`` (the default)
        is right, and ``"avg"`` would divide it by the world size, so the workers
        refuse ``"avg"``, whichever client asks, until ``zero_grad``,
        ``train_step`` or a ``"sum"`` (after which every worker holds the same
        full gradient, which ``"avg"`` leaves as it is). ``"avg"`` is for
        gradients of per-worker mean losses (what DDP averages), e.g. after local
        steps on each worker's own data.

        Args:
            name: the model.
            op: ``"sum"`` or ``"avg"`` (or the ``ReduceOp``). Defaults to ``"sum"``.
            bucket_bytes: the bucket size in bytes; None means 25 MiB.
                Defaults to ``None``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.

        Returns:
            None, or a ``Work`` with ``async_op``.

        Raises:
            InvalidArgument: ``op`` is not sum/avg, ``"avg"`` on gradients left by a
                DataParallel backward (any client's), or a bad bucket size.
            NotFound: the model is missing on every rank.
            FailedPrecondition: the model is missing on some ranks.
        """
        validate_name(name, "model name")
        reduce_op = parse_reduce_op(op)
        if reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise InvalidArgument(f"all_reduce_gradients takes op 'sum' or 'avg', not {op!r}")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise InvalidArgument(f"bucket_bytes must be positive, got {bucket_bytes}")
        deadline = self._session.deadline(timeout)
        return self._leader_op(
            f"all_reduce_gradients {name!r}",
            "AllReduceGradients",
            lambda options: worker_pb2.AllReduceGradientsRequest(
                options=options, model=name, op=reduce_op.wire, bucket_bytes=bucket_bytes or 0
            ),
            deadline,
            async_op,
            lambda response: None,
        )

    def train_step(
        self,
        name: str,
        inputs: str,
        targets: str,
        loss: str | nn.Module | Callable[..., torch.Tensor] = "mse",
        optimizer: str | None = None,
        bucket_bytes: int | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        *,
        max_grad_norm: float | None = None,
        **hyper: Any,
    ) -> Any:
        """A DDP-style step on data already on the workers; returns the loss it optimised.

        Every worker runs the model in train mode (whatever mode it is recorded
        in, which stays as it is) on the tensors named ``inputs``/``targets`` in
        its store and computes ``loss`` over its shard. The step optimises one
        objective, the loss over the whole batch as one ``nn.DataParallel`` step
        computes it: each shard's loss weighed by its share of the rows,
        ``sum(rows_r / rows * loss_r)`` (the full-batch mean for a mean loss,
        even and uneven shards alike). That is the loss returned, and its
        gradient is the one every worker holds afterwards (bucketed), clipped to
        ``max_grad_norm`` when given. A worker whose shard is empty contributes
        nothing. With ``optimizer`` each worker then steps (the model's version
        +1). See ``docs/training.md``.

        Args:
            name: the model.
            inputs: the name of the input tensor in each worker's store.
            targets: the name of the target tensor in each worker's store.
            loss: a built-in loss name (``"mse"``, ``"cross_entropy"``), or your
                own: an ``nn.Module`` or a function of ``(output, target)``
                returning one number, exported with ``torch.export`` (traced on
                tensors shaped like the model's output on rank 0's shard and its
                targets) and loaded on every worker once. Defaults to ``"mse"``.
            optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"`` to step after the
                reduction; None means no step. Defaults to ``None``.
            bucket_bytes: the gradient bucket size in bytes; None means 25 MiB.
                Defaults to ``None``.
            timeout: seconds for the whole call; None means ``default_timeout_s``
                (after a first load of a ``loss`` module, which allows
                ``MODEL_LOAD_TIMEOUT_S`` as ``load_model`` does). Defaults to ``None``.
            async_op: return a ``Work`` at once instead of waiting. Defaults to ``False``.
            max_grad_norm: clip the averaged gradients to this total 2-norm
                before the step, as ``clip_grad_norm_``; None means no clipping.
                Defaults to ``None``.
            **hyper: the optimizer's hyperparameters (JSON numbers), e.g. ``lr``.

        Returns:
            The global loss, or a ``Work`` of it with ``async_op``.

        Raises:
            InvalidArgument: an unknown loss, optimizer or hyperparameter, or a bad
                name; also when torch refuses a shard (batch norm on one row in
                train mode), with nothing changed on any worker.
            NotFound: the model or a tensor is missing.
            Unavailable: a rank was lost, the generation changed, or not formed.
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        validate_name(name, "model name")
        validate_name(inputs, "inputs tensor name")
        validate_name(targets, "targets tensor name")
        if isinstance(loss, str) and loss not in BUILTIN_LOSSES:
            raise InvalidArgument(
                f"loss {loss!r} is not supported; use one of {BUILTIN_LOSSES}, or pass your "
                "own loss as an nn.Module or a function of (output, target)"
            )
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise InvalidArgument(f"optimizer {optimizer!r} is not one of {OPTIMIZERS}")
        clip = _max_grad_norm(max_grad_norm)
        hyper_json = _hyper_json(hyper)
        deadline = self._session.deadline(timeout)
        if not isinstance(loss, str):
            loss_module = as_module(loss, "loss")
            if timeout is None:  # the load gets its own allowance, the step the default
                loss = self._loss_program(name, inputs, targets, loss_module, self._load_deadline())
                deadline = self._session.deadline(None)
            else:
                loss = self._loss_program(name, inputs, targets, loss_module, deadline)
        return self._leader_op(
            f"train_step {name!r}",
            "TrainStep",
            lambda options: worker_pb2.TrainStepRequest(
                options=options,
                model=name,
                inputs=inputs,
                targets=targets,
                loss=loss,
                optimizer=optimizer or "",
                hyper_json=hyper_json,
                bucket_bytes=bucket_bytes or 0,
                max_grad_norm=clip,
            ),
            deadline,
            async_op,
            lambda response: response.loss,
        )

    def step(
        self,
        name: str,
        optimizer: str = "sgd",
        timeout: float | None = None,
        *,
        max_grad_norm: float | None = None,
        **hyper: Any,
    ) -> None:
        """Steps the optimizer of model ``name`` on every worker (state kept per worker).

        The step is one op of the leader's order, as ``all_reduce_gradients`` and
        ``publish`` are: every rank takes it at the same point, so two clients'
        steps run in one order everywhere and each is one version on every rank.
        A different optimizer kind than before starts fresh state; other
        hyperparameters (``lr`` each step, for a schedule) keep it. The gradients
        are clipped to ``max_grad_norm`` first when given. Each step is a new
        model version (+1).

        Args:
            name: the model.
            optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``. Defaults to ``"sgd"``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            max_grad_norm: clip each worker's gradients to this total 2-norm
                before stepping; None means no clipping. Defaults to ``None``.
            **hyper: the optimizer's hyperparameters (JSON numbers), e.g. ``lr``.

        Raises:
            InvalidArgument: unknown optimizer or hyperparameter, or a
                ``max_grad_norm`` that is not a positive number.
            NotFound: the model is not loaded.
            CollectiveError: a worker failed or the call timed out.
        """
        validate_name(name, "model name")
        if optimizer not in OPTIMIZERS:
            raise InvalidArgument(f"optimizer {optimizer!r} is not one of {OPTIMIZERS}")
        request = worker_pb2.StepRequest(
            model=name,
            optimizer=optimizer,
            hyper_json=_hyper_json(hyper),
            max_grad_norm=_max_grad_norm(max_grad_norm),
        )
        self._sequenced_per_model(f"step {name!r}", "Step", request, timeout)

    def zero_grad(self, name: str, timeout: float | None = None) -> None:
        """Clears every parameter's gradient (sets it to None) on every worker, as one
        op of the leader's order (with ``all_reduce_gradients``, ``step``, ``train_step``).

        Args:
            name: the model.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Raises:
            NotFound: the model is not loaded.
            CollectiveError: a worker failed or the call timed out.
        """
        validate_name(name, "model name")
        request = worker_pb2.ZeroGradRequest(model=name)
        self._sequenced_per_model(f"zero_grad {name!r}", "ZeroGrad", request, timeout)

    def gradients(
        self, name: str, rank: int = 0, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Parameters with a gradient on ``rank``, keyed like ``named_parameters()``.

        Args:
            name: the model.
            rank: the global rank to read from. Defaults to ``0``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            Parameter name to gradient (CPU tensors).

        Raises:
            InvalidArgument: ``rank`` is out of range.
            NotFound: the model is not loaded.
            CollectiveError: the worker failed or the call timed out.
        """
        return self._model_tensors(name, "gradients", rank, timeout)

    def state_dict(
        self, name: str, rank: int = 0, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` on ``rank``.

        Args:
            name: the model.
            rank: the global rank to read from. Defaults to ``0``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            Key to tensor (CPU tensors).

        Raises:
            InvalidArgument: ``rank`` is out of range.
            NotFound: the model is not loaded.
            CollectiveError: the worker failed or the call timed out.
        """
        return self._model_tensors(name, "state_dict", rank, timeout)

    def publish(
        self,
        name: str,
        state_dict: dict[str, torch.Tensor],
        *,
        strict: bool = True,
        cast: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Publishes new weights for model ``name``.

        The client uploads each entry of the state dict once, to the leader,
        whatever the world size; one sequenced op then has the workers check it
        against their model, broadcast it among themselves, stage it beside the
        live weights and commit it on every rank at one point of the op order,
        or on none. A ``dp(x)`` running meanwhile finishes on one version, and
        no output mixes two versions.

        As with ``nn.Module.load_state_dict``, ``strict=False`` publishes any
        subset of the keys (the others keep their values) and ``cast=True``
        converts entries whose dtype differs from the model's (e.g. a bfloat16
        state dict into a float32 model); without it a dtype mismatch is
        ``InvalidArgument``, as are unknown or missing keys and a wrong shape.
        Every rank needs room for the staged copy of the published entries (the
        ``--max-tensor-bytes`` quota counts it until the commit).

        Args:
            name: the model.
            state_dict: key to tensor, as ``nn.Module.state_dict()``.
            strict: every key of the model must be given; False takes any subset
                (the others keep their values). Defaults to ``True``.
            cast: convert entries whose dtype differs from the model's (otherwise
                refused). Defaults to ``False``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.

        Returns:
            The version every rank now serves.

        Raises:
            InvalidArgument: unknown or missing keys, a shape or dtype mismatch, an
                empty state dict.
            NotFound: the model is missing on every rank.
            FailedPrecondition: the model is missing on some ranks.
            ResourceExhausted: quota, or retained graphs of a version older than
                the live one still exist, so a third version would be resident
                (reason ``VERSIONS_RESIDENT``): run their backward or drop their
                outputs, then publish again.
        """
        deadline = self._session.deadline(timeout)
        what = f"publish {name!r}"
        response = self._session.ordered(
            what,
            lambda: _publish.publish(self._session, name, state_dict, strict, cast, deadline),
            deadline,
            False,
        )
        return int(response.version)

    def load_state_dict(
        self,
        name: str,
        state_dict: dict[str, torch.Tensor],
        timeout: float | None = None,
        *,
        strict: bool = True,
        cast: bool = False,
    ) -> int:
        """Loads ``state_dict`` into the model on every worker: :meth:`publish` under
        the name ``nn.Module`` uses.

        Args:
            name: the model.
            state_dict: key to tensor, as ``nn.Module.state_dict()``.
            timeout: seconds for the whole call; None means ``default_timeout_s``.
                Defaults to ``None``.
            strict: every key of the model must be given; False takes any subset.
                Defaults to ``True``.
            cast: convert entries whose dtype differs from the model's.
                Defaults to ``False``.

        Returns:
            The new version.

        Raises:
            InvalidArgument: unknown or missing keys, a shape or dtype mismatch, an
                empty state dict.
            NotFound: the model is missing on every rank.
            FailedPrecondition: the model is missing on some ranks.
            ResourceExhausted: quota, or too many versions resident (see :meth:`publish`).
        """
        return self.publish(name, state_dict, strict=strict, cast=cast, timeout=timeout)

    def apply(
        self,
        fn: nn.Module | Callable[..., Any],
        inputs: str | Sequence[str],
        out: str | Sequence[str],
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Runs ``fn`` on the tensors named ``inputs`` on each rank; stores its outputs as ``out``.

        ``fn`` never travels as Python: it is exported with ``torch.export``
        (traced on tensors shaped like the first target rank's inputs,
        dimension 0 dynamic) and the workers check and load the program as
        they do a model's (under ``__fn/<digest>``, hidden from ``models()``),
        once per function and input signature. It runs without autograd, in
        parallel, each rank on its own tensors.

        Args:
            fn: an ``nn.Module`` or a function of tensors returning a tensor or
                a tuple of tensors; it must be exportable.
            inputs: the name, or names in order, of the tensors passed to ``fn``.
            out: one name per output tensor; tensors of those names are
                replaced, all of a rank's outputs or none.
            ranks: the global ranks to run on; None means every member.
                Defaults to ``None``.
            timeout: seconds for the whole call (export, load, run); None
                means ``default_timeout_s`` for the run, after a first load of
                ``fn`` that allows ``MODEL_LOAD_TIMEOUT_S`` as ``load_model``
                does. Defaults to ``None``.

        Raises:
            InvalidArgument: a bad name or rank, ``fn`` cannot be exported, the
                workers refused its program (an operator off their allowlist),
                it failed on a rank's tensors, or it returned another number
                of tensors than ``out`` names.
            NotFound: an input is missing on a rank.
            ResourceExhausted: the outputs do not fit a rank's memory quota.
            CollectiveError: a worker failed or the call timed out.
        """
        input_names = _names(inputs, "inputs")
        output_names = _names(out, "out")
        module = as_module(fn, "fn")
        deadline = self._session.deadline(timeout)
        endpoints = self._member_endpoints(deadline)
        targets = sorted(endpoints) if ranks is None else _ranks_of(ranks, endpoints)
        infos = self._tensor_infos(endpoints[targets[0]], input_names, deadline)
        examples = tuple(example_like(infos[n]) for n in input_names)
        if timeout is None:  # the load gets its own allowance, the run the default
            program = self._program(module, examples, self._load_deadline())
            deadline = self._session.deadline(None)
        else:
            program = self._program(module, examples, deadline)
        args = worker_pb2.Value(
            tuple=worker_pb2.ValueList(items=[worker_pb2.Value(tensor=n) for n in input_names])
        )

        def start(endpoint: WorkerEndpoint) -> Call[worker_pb2.ForwardResponse]:
            request = worker_pb2.ForwardRequest(
                model=program,
                call_id=f"apply-{uuid.uuid4().hex}",
                args=args,
                output_names=output_names,
            )
            return endpoint.unary("Forward").future(request, self._remaining(deadline), "apply")

        calls = {r: (lambda e=endpoints[r]: start(e)) for r in targets}
        try:
            self._session.fan_out("apply", calls)
        except NotFound as err:
            if program not in err.message:
                raise
            self._programs.forget(program)  # a replaced worker lacks it: load, run once more
            self._program(module, examples, deadline)
            self._session.fan_out("apply", calls)

    # -------------------------------------------------------------- helpers
    def _load_deadline(self, timeout: float | None = None) -> float:
        """The deadline of a call that loads an archive: ``timeout`` from now, by
        default the usual one plus the time a worker gives one load."""
        if timeout is None:
            timeout = self._session.default_timeout_s + MODEL_LOAD_TIMEOUT_S
        return self._session.deadline(timeout)

    def _program(self, module: nn.Module, example_inputs: tuple[Any, ...], deadline: float) -> str:
        """Loads ``module``'s program on every member unless this client already did;
        returns the reserved model name it is loaded under."""
        archive = self._programs.archive(module, example_inputs)
        name = program_name(archive)
        snapshot = self._session.formed_snapshot(deadline)
        members = frozenset(w.worker_id for w in snapshot.workers if w.rank >= 0)
        if not self._programs.loaded_on(name, members):
            spec = worker_pb2.ModelSpec(name=name, archive_nbytes=len(archive))
            self._load_everywhere(
                f"the program of {type(module).__name__}", spec, archive, deadline
            )
            self._programs.mark_loaded(name, members)
        return name

    def _tensor_infos(
        self, endpoint: WorkerEndpoint, names: list[str], deadline: float
    ) -> dict[str, worker_pb2.TensorInfo]:
        """Dtype and shape of each of ``names`` on that worker.

        Raises:
            NotFound: one of them is not there.
        """
        response = endpoint.unary("ListTensors")(
            worker_pb2.ListTensorsRequest(names=names),
            self._remaining(deadline),
            "the inputs' shapes",
        )
        infos = {info.name: info for info in response.tensors}
        missing = [n for n in names if n not in infos]
        if missing:
            raise NotFound(
                f"tensor(s) {', '.join(repr(n) for n in missing)} not found on {endpoint.address}",
                tensor=missing[0],
            )
        return infos

    def _loss_program(
        self, model: str, inputs: str, targets: str, loss: nn.Module, deadline: float
    ) -> str:
        """Loads ``loss`` as a program of ``(output, target)`` and returns its name.

        It is traced on tensors shaped like the model's output on rank 0's
        ``inputs`` (one forward without autograd, learnt once per model and
        input signature) and like rank 0's ``targets``.
        """
        endpoint = self._member_endpoints(deadline)[0]
        infos = self._tensor_infos(endpoint, [inputs, targets], deadline)
        key = (model, _shape_key(infos[inputs]), _shape_key(infos[targets]))
        with self._examples_lock:
            output = self._output_examples.get(key)
        if output is None:
            output = self._output_example(endpoint, model, inputs, deadline)
            with self._examples_lock:
                self._output_examples[key] = output
        return self._program(loss, (output, example_like(infos[targets])), deadline)

    def _output_example(
        self, endpoint: WorkerEndpoint, model: str, inputs: str, deadline: float
    ) -> Any:
        """Tensors shaped like ``model``'s output on ``inputs`` on that worker (its
        structure kept), from one forward without autograd whose outputs are deleted."""
        call_id = f"shape-{uuid.uuid4().hex}"
        request = worker_pb2.ForwardRequest(
            model=model,
            call_id=call_id,
            mode=worker_pb2.MODEL_MODE_EVAL,  # eval mode changes no running statistic
            args=worker_pb2.Value(
                tuple=worker_pb2.ValueList(items=[worker_pb2.Value(tensor=inputs)])
            ),
        )
        response = endpoint.unary("Forward")(
            request, self._remaining(deadline), f"a forward of {model!r}"
        )
        names = tensor_leaves(response.output)
        try:
            infos = self._tensor_infos(endpoint, names, deadline)
        finally:
            for name in names:
                with contextlib.suppress(CollectiveError):
                    endpoint.unary("DeleteTensor")(
                        worker_pb2.DeleteTensorRequest(name=name, missing_ok=True),
                        self._remaining(deadline),
                        "delete",
                    )
        return from_value(response.output, lambda name: example_like(infos[name]))

    def _remaining(self, deadline: float) -> float:
        return time_left(deadline, "the model call")

    def _member_endpoints(self, deadline: float) -> dict[int, WorkerEndpoint]:
        snapshot = self._session.serving_snapshot(deadline)
        return {w.rank: self._session.endpoint(w.address) for w in snapshot.workers if w.rank >= 0}

    def _per_rank(self, what: str, deadline: float, method: str, request: Any) -> dict[int, Any]:
        """The Worker RPC ``method`` (idempotent: UnloadModel, SetModelMode) with
        ``request`` on every member, answers by rank; sent to every member again, as
        the cluster is then, when one refused it before doing anything (drained)."""

        def attempt(_left: float) -> dict[int, Any]:
            endpoints = self._member_endpoints(deadline)
            return self._session.fan_out(
                what,
                {
                    rank: (
                        lambda e=e: e.unary(method).future(request, self._remaining(deadline), what)
                    )
                    for rank, e in endpoints.items()
                },
            )

        return self._session.retry(what, deadline, attempt, is_not_executed)

    def _model_tensors(
        self, name: str, which: str, rank: int, timeout: float | None
    ) -> dict[str, torch.Tensor]:
        validate_name(name, "model name")
        deadline = self._session.deadline(timeout)
        endpoints = self._member_endpoints(deadline)
        if rank not in endpoints:
            raise InvalidArgument(
                f"rank {rank} is out of range: world size is {len(endpoints)} "
                f"(valid ranks 0..{len(endpoints) - 1})"
            )

        def attempt(remaining: float) -> dict[str, torch.Tensor]:
            endpoint = self._member_endpoints(time.monotonic() + remaining)[rank]
            return get_model_tensors(endpoint, name, which, remaining)

        return self._session.retry(f"{which} of {name!r}", deadline, attempt, is_retryable_read)

    def _sequenced_per_model(self, what: str, method: str, request: Any, timeout: float | None):
        """``method`` (Step, ZeroGrad) as one op of the leader's order, on every rank. A
        leader of the release before runs it on its own rank only (it answers no op
        id): the other ranks then get it each on its own, as that release did."""
        deadline = self._session.deadline(timeout)

        def with_options(options: worker_pb2.OpOptions) -> Any:
            sent = type(request)()
            sent.CopyFrom(request)
            sent.options.CopyFrom(options)
            return sent

        response = self._leader_op(what, method, with_options, deadline, False, lambda r: r)
        if response.op_id:
            return
        leader = self._session.leader_snapshot(deadline).leader_address
        endpoints = self._member_endpoints(deadline)
        self._session.fan_out(
            what,
            {
                rank: (lambda e=e: e.unary(method).future(request, self._remaining(deadline), what))
                for rank, e in endpoints.items()
                if e.address != leader
            },
        )

    def _leader_op(self, what: str, method: str, request, deadline: float, async_op: bool, finish):
        binding = GenerationBinding(what)
        record = IssuedOp()

        def attempt(remaining: float):
            snapshot = self._session.leader_snapshot(time.monotonic() + remaining)
            binding.bind(snapshot.generation, snapshot)
            record.generation = snapshot.generation
            options = worker_pb2.OpOptions(
                generation=snapshot.generation,
                timeout_s=server_timeout_s(remaining),
                membership_digest=snapshot.membership_digest,
                reissued_from=binding.reissued_from,
            )
            leader = snapshot.leader_address or ""
            return self._session.endpoint(leader).unary(method)(
                request(options), remaining, f"{what} on {leader}"
            )

        def run() -> Any:
            return finish(self._session.retry(what, deadline, attempt, binding.retryable))

        return self._session.ordered(what, run, deadline, async_op, record)

    def release_graph(self, model: str, call_id: str, endpoints: list[WorkerEndpoint]) -> None:
        """Fire-and-forget release of a data-parallel call's retained graphs."""
        if self._session.closed:
            return
        request = worker_pb2.ReleaseGraphRequest(model=model, call_id=call_id)
        for endpoint in endpoints:
            # On failure the worker's --graph-ttl-s releases the graph anyway.
            with contextlib.suppress(CollectiveError, ValueError, RuntimeError):
                future = endpoint.stub.ReleaseGraph.future(request, timeout=5.0)
                # A gRPC future that is garbage-collected cancels its call: keep it.
                self._releases.add(future)
                future.add_done_callback(self._releases.discard)


def _names(names: str | Sequence[str], what: str) -> list[str]:
    """``names`` as a checked, non-empty list of tensor names."""
    listed = [names] if isinstance(names, str) else list(names)
    if not listed:
        raise InvalidArgument(f"{what} must name at least one tensor")
    for name in listed:
        validate_name(name, f"{what} name")
    return listed


def _ranks_of(ranks: Sequence[int], endpoints: dict[int, WorkerEndpoint]) -> list[int]:
    """``ranks``, checked against the members, in order, without repeats."""
    listed = list(ranks)
    if not listed:
        raise InvalidArgument("ranks must name at least one rank (None: every rank)")
    for rank in listed:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank not in endpoints:
            raise InvalidArgument(
                f"rank {rank!r} is out of range: world size is {len(endpoints)} "
                f"(valid ranks 0..{len(endpoints) - 1})"
            )
    if len(set(listed)) != len(listed):
        raise InvalidArgument(f"ranks repeat a rank: {listed}")
    return listed


def _shape_key(info: worker_pb2.TensorInfo) -> tuple[int, tuple[int, ...]]:
    return int(info.dtype), tuple(info.shape[1:])


def _max_grad_norm(max_grad_norm: float | None) -> float:
    """The clipping norm for the wire (0: none), checked."""
    if max_grad_norm is None:
        return 0.0
    if (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, (int, float))
        or not math.isfinite(max_grad_norm)
        or max_grad_norm <= 0
    ):
        raise InvalidArgument(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
    return float(max_grad_norm)


def _hyper_json(hyper: dict[str, Any]) -> str:
    try:
        return json.dumps(hyper)
    except TypeError as exc:
        raise InvalidArgument(f"optimizer hyperparameters must be JSON numbers: {exc}") from None


def _model_info(m: worker_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        name=m.name,
        parameters=m.parameters,
        parameter_bytes=m.parameter_bytes,
        devices=list(m.devices),
        source=m.source,
        optimizer=m.optimizer,
        steps=m.steps,
        version=m.version,
        training=m.training,
        batch_statistics=m.batch_statistics,
        running_statistics=m.running_statistics,
        load_id=m.load_id,
        batching=Batching.from_proto(m.batching) if m.HasField("batching") else None,
        batches=m.batching_stats.batches,
        batched_calls=m.batching_stats.calls,
        batched_rows=m.batching_stats.rows,
    )
