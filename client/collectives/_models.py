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
:class:`~collectives._session.Session` and the
:class:`~collectives._data_plane.DataPlane` (whose shared-memory rule decides
how an archive travels). ``DataParallel`` (``data_parallel``) runs on a session
and a ``Models``: it records here which gradients it accumulated and hands back
the graphs it retained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from collectives import _publish
from collectives._archive_staging import load_staged, stage_archive
from collectives._data_plane import DataPlane
from collectives._deadlines import time_left
from collectives._generation_binding import GenerationBinding
from collectives._model_transport import get_model_tensors, load_model_on
from collectives._progress import progress
from collectives._session import Session, server_timeout_s
from collectives._transport import WorkerEndpoint, call_unary, is_retryable_read
from collectives.errors import CollectiveError, InvalidArgument, NotFound
from collectives.reduce_ops import ReduceOp, parse_reduce_op
from collectives.v1 import worker_pb2
from collectives.wire.names import BUILTIN_LOSSES, OPTIMIZERS, validate_name
from collectives.work import OpRecord

__all__ = ["ModelInfo", "Models", "export_archive"]


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
    # The mode forwards run in, like nn.Module.training (see set_model_mode).
    training: bool = True


def export_archive(module: nn.Module, example_inputs: tuple[Any, ...], dim: int = 0) -> bytes:
    """A torch.export archive of ``module`` with dimension ``dim`` of every tensor input dynamic.

    Raises:
        InvalidArgument: the module cannot be exported (the message says why and
            names the factory alternative).
    """
    from torch.export import Dim
    from torch.utils._pytree import tree_map

    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    dynamic = tree_map(
        lambda t: {dim: Dim.DYNAMIC} if isinstance(t, torch.Tensor) and t.dim() > dim else None,
        example_inputs,
    )
    try:
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


class Models:
    """The model calls of :class:`~collectives.Cluster` (see the module)."""

    def __init__(self, session: Session, data_plane: DataPlane) -> None:
        self._session = session
        self._data_plane = data_plane
        # In-flight fire-and-forget ReleaseGraph calls (see release_graph).
        self._releases: set[Any] = set()
        # Models whose gradients on the workers came from a DataParallel backward of
        # a loss over the whole batch (until zero_grad or train_step): their shards'
        # gradients already add up to the full-batch gradient.
        self._whole_batch_grads: set[str] = set()
        self._grads_lock = threading.Lock()

    def note_remote_backward(self, name: str) -> None:
        """A DataParallel backward of ``name`` accumulated gradients on the workers."""
        with self._grads_lock:
            self._whole_batch_grads.add(name)

    def _forget_gradients(self, name: str) -> None:
        with self._grads_lock:
            self._whole_batch_grads.discard(name)

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
    ) -> ModelInfo:
        """Loads a model on every worker, replacing one of the same name.

        Either ``module`` with ``example_inputs`` (shipped as a torch.export
        archive with dim 0 dynamic; one of 4 MiB or more on two or more workers
        is sent once and broadcast among them, a smaller one streamed to each
        worker), or ``factory="pkg.module:fn"`` with JSON
        ``kwargs`` (the workers must allow it with ``--allow-factory``).
        ``state_dict`` then loads weights (tensors, never pickle).

        Raises:
            InvalidArgument: the module cannot be exported, or bad arguments.
            PermissionDenied: the factory is not allowed on the workers.
            CollectiveError: a worker refused the model or the call failed.
        """
        validate_name(name, "model name")
        deadline = self._session.deadline(timeout)
        if (module is None) == (factory is None):
            raise InvalidArgument("load_model needs either a module or a factory (not both)")
        if module is not None:
            if example_inputs is None:
                raise InvalidArgument(
                    "load_model(name, module) needs example_inputs to export the module"
                )
            archive = export_archive(module, example_inputs)
            spec = worker_pb2.ModelSpec(name=name, archive_nbytes=len(archive))
        else:
            try:
                kwargs_json = json.dumps(kwargs or {})
            except TypeError as exc:
                raise InvalidArgument(f"factory kwargs must be JSON-serializable: {exc}") from None
            archive = b""
            spec = worker_pb2.ModelSpec(name=name, factory=factory, factory_kwargs_json=kwargs_json)
        endpoints = self._member_endpoints(deadline)
        what = f"load_model {name!r}"
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
                        rank: (
                            lambda e=e: load_model_on(
                                e, spec, archive, self._remaining(deadline), bar
                            )
                        )
                        for rank, e in endpoints.items()
                    },
                )
        else:
            responses = load_staged(self._session, what, spec, archive, staged, endpoints, deadline)
        info = _model_info(responses[min(responses)].model)
        if state_dict is not None:
            version = self.load_state_dict(name, state_dict, timeout=self._remaining(deadline))
            info = dataclasses.replace(info, version=version)
        return info

    def unload_model(
        self, name: str, missing_ok: bool = False, timeout: float | None = None
    ) -> None:
        """Unloads a model from every worker.

        Raises:
            NotFound: no worker had it (unless ``missing_ok``).
        """
        validate_name(name, "model name")
        deadline = self._session.deadline(timeout)
        results = self._per_rank(
            "unload_model",
            deadline,
            lambda e, t: call_unary(
                e.stub.UnloadModel,
                worker_pb2.UnloadModelRequest(name=name, missing_ok=True),
                t,
                f"unload_model {name!r}",
            ),
        )
        if not missing_ok and not any(r.unloaded for r in results.values()):
            raise NotFound(f"model {name!r} is not loaded on any worker")

    def models(self, timeout: float | None = None) -> list[ModelInfo]:
        """Models loaded on the cluster (as rank 0 holds them)."""
        deadline = self._session.deadline(timeout)
        endpoint = self._member_endpoints(deadline)[0]
        response = call_unary(
            endpoint.stub.ListModels,
            worker_pb2.ListModelsRequest(),
            self._remaining(deadline),
            "models",
        )
        return [_model_info(m) for m in response.models]

    def set_model_mode(
        self, name: str, training: bool = True, timeout: float | None = None
    ) -> ModelInfo:
        """Sets the mode model ``name`` runs in on every worker, like
        ``nn.Module.train(training)``: in train mode dropout is on and batch norm
        normalises each shard with its own statistics (updating that worker's
        running ones, as each replica of ``nn.DataParallel`` does); in eval mode
        neither. ``DataParallel.train()`` / ``eval()`` call this.

        Args:
            name: the model.
            training: True for train mode, False for eval mode.
            timeout: seconds for the whole call.

        Returns:
            The model as rank 0 holds it now (``training`` says its mode).

        Raises:
            NotFound: the model is not loaded.
            FailedPrecondition: the model's exported graph holds a mode-dependent
                operator that cannot be switched (export it in the mode to run).
            DeadlineExceeded: not done within ``timeout`` seconds.
        """
        validate_name(name, "model name")
        deadline = self._session.deadline(timeout)
        mode = worker_pb2.MODEL_MODE_TRAIN if training else worker_pb2.MODEL_MODE_EVAL
        request = worker_pb2.SetModelModeRequest(name=name, mode=mode)
        what = f"set_model_mode {name!r}"
        answers = self._per_rank(
            what, deadline, lambda e, left: call_unary(e.stub.SetModelMode, request, left, what)
        )
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
        is right, and ``"avg"`` would divide it by the world size, so this client
        refuses ``"avg"`` until ``zero_grad`` or a ``"sum"`` (after which every worker
        holds the same full gradient, which "avg" leaves as it is). ``"avg"`` is for gradients of
        per-worker mean losses (what DDP averages), e.g. after local steps on
        each worker's own data.

        Raises:
            InvalidArgument: ``op`` is not sum/avg, ``"avg"`` on gradients this
                client computed with a DataParallel backward, or a bad bucket size.
            NotFound / FailedPrecondition: the model is missing on all / some ranks.
        """
        validate_name(name, "model name")
        reduce_op = parse_reduce_op(op)
        if reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise InvalidArgument(f"all_reduce_gradients takes op 'sum' or 'avg', not {op!r}")
        with self._grads_lock:
            whole_batch = name in self._whole_batch_grads
        if reduce_op is ReduceOp.AVG and whole_batch:
            raise InvalidArgument(
                f"all_reduce_gradients({name!r}, op='avg') would divide the gradient by the "
                f"world size: the gradients of {name!r} come from a data_parallel backward of a "
                "loss over the whole batch, so each worker holds its shard's part and their "
                "sum is the full-batch gradient. Use op='sum' (the default). 'avg' is for "
                "per-worker mean losses, as in DDP (see docs/api.md, 'Which reduction')"
            )
        if reduce_op is ReduceOp.SUM:
            self._forget_gradients(name)  # reduced: every rank holds the full gradient
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
        loss: str = "mse",
        optimizer: str | None = None,
        bucket_bytes: int | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        **hyper: Any,
    ) -> Any:
        """A DDP-style step on data already on the workers; returns the global loss.

        Every worker computes ``loss`` (mean over its shard) of the model on the
        tensors named ``inputs``/``targets`` in its store, backpropagates, and
        the gradients are averaged across workers (bucketed). With
        ``optimizer`` (sgd/adam/adamw and ``**hyper``) each worker then steps.
        """
        validate_name(name, "model name")
        validate_name(inputs, "inputs tensor name")
        validate_name(targets, "targets tensor name")
        self._forget_gradients(name)  # it sets the gradients itself, averaged
        if loss not in BUILTIN_LOSSES:
            raise InvalidArgument(f"loss {loss!r} is not supported; use one of {BUILTIN_LOSSES}")
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise InvalidArgument(f"optimizer {optimizer!r} is not one of {OPTIMIZERS}")
        hyper_json = _hyper_json(hyper)
        deadline = self._session.deadline(timeout)
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
            ),
            deadline,
            async_op,
            lambda response: response.loss,
        )

    def step(
        self, name: str, optimizer: str = "sgd", timeout: float | None = None, **hyper: Any
    ) -> None:
        """Steps the optimizer of model ``name`` on every worker (state kept per worker).

        A different optimizer kind than before starts fresh state.

        Raises:
            InvalidArgument: unknown optimizer or hyperparameter.
        """
        validate_name(name, "model name")
        if optimizer not in OPTIMIZERS:
            raise InvalidArgument(f"optimizer {optimizer!r} is not one of {OPTIMIZERS}")
        request = worker_pb2.StepRequest(
            model=name, optimizer=optimizer, hyper_json=_hyper_json(hyper)
        )
        self._per_rank(
            f"step {name!r}",
            self._session.deadline(timeout),
            lambda e, t: call_unary(e.stub.Step, request, t, f"step {name!r}"),
        )

    def zero_grad(self, name: str, timeout: float | None = None) -> None:
        """Clears every parameter's gradient (sets it to None) on every worker."""
        validate_name(name, "model name")
        request = worker_pb2.ZeroGradRequest(model=name)
        self._per_rank(
            f"zero_grad {name!r}",
            self._session.deadline(timeout),
            lambda e, t: call_unary(e.stub.ZeroGrad, request, t, f"zero_grad {name!r}"),
        )
        self._forget_gradients(name)

    def gradients(
        self, name: str, rank: int = 0, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Parameters with a gradient on ``rank``, keyed like ``named_parameters()``."""
        return self._model_tensors(name, "gradients", rank, timeout)

    def state_dict(
        self, name: str, rank: int = 0, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` on ``rank`` (CPU tensors)."""
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
        """Publishes new weights for model ``name``; returns the version every rank now serves.

        The client sends each byte once (to the leader); the workers broadcast
        the weights among themselves, stage them beside the live ones and switch
        at one point of the op order, on every rank or on none. A ``dp(x)``
        running meanwhile finishes on the version it started with, and no output
        mixes two versions. ``strict=False`` takes any subset of the keys (the
        others keep their values); ``cast=True`` converts entries whose dtype
        differs from the model's (otherwise refused).

        Raises:
            InvalidArgument: unknown or missing keys, a shape or dtype mismatch.
            NotFound / FailedPrecondition: the model is missing on all / some ranks.
            ResourceExhausted: quota, or retained graphs of an older version still
                hold it (at most two versions are resident): run their backward or
                drop their outputs, then publish again.
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
        """Loads ``state_dict`` into the model on every worker: :meth:`publish` under the
        name ``nn.Module`` uses. Returns the new version.

        Raises:
            InvalidArgument: unknown or missing keys, or a shape mismatch.
        """
        return self.publish(name, state_dict, strict=strict, cast=cast, timeout=timeout)

    # -------------------------------------------------------------- helpers
    def _remaining(self, deadline: float) -> float:
        return time_left(deadline, "the model call")

    def _member_endpoints(self, deadline: float) -> dict[int, WorkerEndpoint]:
        snapshot = self._session.formed_snapshot(deadline)
        return {w.rank: self._session.endpoint(w.address) for w in snapshot.workers if w.rank >= 0}

    def _per_rank(self, what: str, deadline: float, fn) -> dict[int, Any]:
        endpoints = self._member_endpoints(deadline)
        return self._session.fan_out(
            what,
            {rank: (lambda e=e: fn(e, self._remaining(deadline))) for rank, e in endpoints.items()},
        )

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

    def _leader_op(self, what: str, method: str, request, deadline: float, async_op: bool, finish):
        binding = GenerationBinding(what)
        record = OpRecord()

        def attempt(remaining: float):
            snapshot = self._session.leader_snapshot(time.monotonic() + remaining)
            binding.bind(snapshot.generation)
            record.generation = snapshot.generation
            options = worker_pb2.OpOptions(
                generation=snapshot.generation,
                timeout_s=server_timeout_s(remaining),
                membership_digest=snapshot.membership_digest,
            )
            leader = snapshot.leader_address or ""
            stub_method = getattr(self._session.endpoint(leader).stub, method)
            return call_unary(stub_method, request(options), remaining, f"{what} on {leader}")

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
    )
