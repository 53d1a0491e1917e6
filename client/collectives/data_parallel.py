"""``cluster.data_parallel(name)``: the cluster as one big ``torch.nn.DataParallel``.

A call scatters its inputs across workers exactly as the seed's
``scatter_kwargs`` does across devices, uploads each worker's shard to it
directly (in parallel), runs the model there, and gathers the outputs back in
worker order. When autograd is on, the gathered outputs are the outputs of one
autograd node — the seed's ``Gather`` lifted to workers — whose backward sends
each worker its slice of the gradient, runs backward through the graph the
worker retained, and returns the gradients of the client's inputs that need
them. Parameter ``.grad`` accumulates on the workers; aggregate it with
``cluster.all_reduce_gradients``. A graph whose backward never comes is
released when the client drops the outputs (and, as a backstop, by the
worker's ``--graph-ttl-s``).
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from collectives._deadlines import time_left
from collectives.errors import (
    CollectiveError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
    Unavailable,
)
from collectives.models.part import ModelInfo, Models
from collectives.session.connection import Session, without_models
from collectives.transport.calls import Call, Job, Mapped, Start
from collectives.transport.endpoints import WorkerEndpoint, get_tensor, put_tensor
from collectives.transport.roads import INLINE_BYTES, InlineBudget
from collectives.v1 import worker_pb2
from collectives.wire.cluster_state import WorkerInfo
from collectives.wire.codec import tensor_from_proto, tensor_to_proto
from collectives.wire.names import validate_name
from collectives.wire.pytree import (
    InlineLeaf,
    fill_value,
    from_value,
    gather,
    inline_leaves,
    replace_tensors,
    scatter_kwargs,
    tensor_leaves,
    tensors_in,
)

__all__ = ["DataParallel"]

R = TypeVar("R")


def _namedtuple_types(obj: Any, found: dict[str, type] | None = None) -> dict[str, type]:
    found = {} if found is None else found
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        found[type(obj).__name__] = type(obj)
    if isinstance(obj, (tuple, list)):
        for o in obj:
            _namedtuple_types(o, found)
    elif isinstance(obj, dict):
        for o in obj.values():
            _namedtuple_types(o, found)
    return found


# Whole-call attempts when publishes keep moving the model's version under a forward.
_VERSION_ATTEMPTS = 8
# The first pause before a call whose shards ran two loads of the model runs again.
_RELOAD_PAUSE_S = 0.005
# Placements a call placed by load gets, each away from the workers that failed it.
_PLACEMENTS = 4


def _inline(name: str, t: torch.Tensor) -> worker_pb2.InlineTensor:
    return worker_pb2.InlineTensor(name=name, tensor=tensor_to_proto(t))


def _decode_inline(leaves: Any) -> dict[str, torch.Tensor]:
    try:
        return {leaf.name: tensor_from_proto(leaf.tensor) for leaf in leaves}
    except InvalidArgument as err:
        raise InvalidArgument(f"a worker sent a malformed inline tensor: {err.message}") from None


def _noting(shard: int, failed: set[int], fn: Callable[[], R]) -> R:
    """``fn()``, adding ``shard`` to ``failed`` if it raises a CollectiveError."""
    try:
        return fn()
    except CollectiveError:
        failed.add(shard)
        raise


class _Noted(Generic[R]):
    """A shard's call that notes the shard in ``failed`` when it fails."""

    __slots__ = ("_call", "_failed", "_shard")

    def __init__(self, call: Call[R], shard: int, failed: set[int]) -> None:
        self._call = call
        self._shard = shard
        self._failed = failed

    def result(self) -> R:
        return _noting(self._shard, self._failed, self._call.result)


@dataclass
class _Shard:
    rank: int
    endpoint: WorkerEndpoint
    chunk_shapes: dict[int, torch.Size] = field(default_factory=dict)  # leaf index -> shape
    output_names: list[str] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _CallState:
    """What the release finalizer needs; holds no reference to the autograd graph."""

    models: Models
    model: str
    call_id: str
    shards: list[_Shard]
    finished: bool = False


def _release(state: _CallState) -> None:
    if state.finished:
        return
    state.finished = True
    state.models.release_graph(state.model, state.call_id, [s.endpoint for s in state.shards])


class _RemoteCall:
    """One data-parallel call: scatter, remote forward, gather; and its backward."""

    def __init__(
        self,
        session: Session,
        models: Models,
        model: str,
        dim: int,
        timeout: float | None,
        training: bool | None = None,
        info: ModelInfo | None = None,
        deadline: float | None = None,
    ) -> None:
        self.session = session
        self.models = models
        self.model = model
        self.dim = dim
        # The mode every shard runs in; None: the model's recorded mode.
        self.mode = {
            None: worker_pb2.MODEL_MODE_UNSPECIFIED,
            True: worker_pb2.MODEL_MODE_TRAIN,
            False: worker_pb2.MODEL_MODE_EVAL,
        }[training]
        # A model that normalises over the batch (batch norm) gets no one-row shard in
        # train mode; one that keeps running statistics (batch or instance norm) holds
        # each worker's own, so its calls are never placed by load, and a shard that
        # ran in train mode is never run again (its statistics moved once already).
        batch_statistics = info is not None and info.batch_statistics
        self.per_worker_state = info is not None and (info.running_statistics or batch_statistics)
        self.min_rows = 2 if training and batch_statistics else 1
        # The load those rules are of: a worker holding another load refuses the call.
        self.load_id = info.load_id if info is not None else ""
        # Train mode moves each worker's statistics: a shard that ran once (in
        # ``counted``) runs again without moving them twice (statistics_counted).
        self.moves_statistics = bool(training) and self.per_worker_state
        self.counted: set[int] = set()
        self.deadline = session.deadline(timeout) if deadline is None else deadline
        self.call_id = ""
        self.version = 0  # the model version that computed the outputs, once known
        self.routed = False  # the parts were placed by load (_placement), not by rank
        self.replicas_differed = False  # a worker answered that the replicas may differ

    def forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The gathered outputs. A forward that only reads the model (no autograd) and
        splits into fewer parts than there are members has its parts placed by load
        (``_placement``), and is placed again, away from a worker that failed it with
        ``UNAVAILABLE``, within its deadline, when its output cannot depend on the
        worker: the replicas are known to be the same, and the model keeps no
        per-worker running statistics (a batch or instance norm's)."""
        grad_on = torch.is_grad_enabled()
        placement = self.models.placement
        routable = not grad_on and not self.per_worker_state and placement.may_route(self.model)
        # One more than the placements: the run where a split runs it, after a placed
        # one learned that the replicas may differ.
        for attempt in range(1, _PLACEMENTS + 2):
            failed: set[int] = set()
            try:
                output = self._forward_once(inputs, kwargs, grad_on, routable, failed)
            except (Unavailable, DeadlineExceeded) as err:
                # Without autograd an eval-mode forward has no side effect: one whose
                # worker was unavailable (it stopped, or was drained: its rank moved)
                # runs again, placed anew or split over the members the view now has.
                # So does one that a worker cut short before this call's deadline (a
                # stopping worker's server cancels the calls it still runs: CANCELLED).
                # With autograd, only one that a worker refused before running it (a
                # drained rank takes no graph); their graphs were released. A shard
                # that ran in train mode moved its worker's running statistics, so a
                # call that moves them runs again only if none of its shards ran.
                if self.moves_statistics:
                    rerun = err.executed is False and not self.counted
                else:
                    rerun = not grad_on or err.executed is False
                if not rerun or not failed or err.reason == Reason.VERSION_MOVED:
                    raise
                if isinstance(err, DeadlineExceeded) and time.monotonic() >= self.deadline:
                    raise
                if attempt >= _PLACEMENTS or time.monotonic() >= self.deadline:
                    raise  # no other placement left to try: the worker's own error
                for i in failed:
                    placement.avoid(self.shards[i].endpoint.address)
                if not self.routed:
                    self.session.refresh_after_failure(self.deadline)
                continue
            if not (self.routed and self.replicas_differed):
                return output
            # Another client's step made the replicas differ after this client last
            # heard: the answer may come from a worker a split would not use. Run it
            # again where a split runs it (no autograd: nothing to undo).
            routable = False
        raise AssertionError("unreachable: the last placement returns or raises")

    def _serving_members(self, routable: bool) -> tuple[list[WorkerInfo], bool]:
        """The members to run the parts on, by rank, and whether they are fewer than
        the generation's. A forward placed by load needs no particular rank: while a
        drain hands a rank over, it runs on the members that serve the models now
        (see :func:`without_models`) instead of waiting for the successor to join."""
        if routable:
            snapshot = self.session.formed_snapshot(self.deadline)
            lacking = without_models(snapshot)
            members = snapshot.members
            serving = [w for w in members if w.worker_id not in lacking]
            if serving:
                return serving, len(serving) < len(members)
        grad_on = torch.is_grad_enabled()
        snapshot = self.session.serving_snapshot(self.deadline, retains_graphs=grad_on)
        return snapshot.members, False

    def _forward_once(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        grad_on: bool,
        routable: bool,
        failed: set[int],
    ) -> Any:
        """One attempt of :meth:`forward`; the shards whose call failed go in ``failed``."""
        self.call_id = f"__dp/{uuid.uuid4().hex}"
        self.replicas_differed = False
        self.counted = set()
        members, narrowed = self._serving_members(routable)
        parts_args, parts_kwargs = scatter_kwargs(
            inputs, kwargs, len(members), self.dim, self.min_rows
        )
        self.routed = routable and (narrowed or len(parts_args) < len(members))
        placement = self.models.placement
        if self.routed:
            placed = placement.choose(members, len(parts_args))
        else:
            placed = members[: len(parts_args)]
        all_leaves = tensors_in(inputs) + tensors_in(kwargs)
        self.grad_leaf_ids = [
            k
            for k, t in enumerate(all_leaves)
            if grad_on and t.requires_grad and (t.is_floating_point() or t.is_complex())
        ]
        self.grad_leaves = [all_leaves[k] for k in self.grad_leaf_ids]
        self.shards = [_Shard(w.rank, self.session.endpoint(w.address)) for w in placed]
        self.state = _CallState(self.models, self.model, self.call_id, self.shards)
        types = _namedtuple_types((inputs, kwargs))

        def request_of(i: int, version: int) -> worker_pb2.ForwardRequest:
            shard = self.shards[i]
            counter = iter(range(1 << 30))

            budget = InlineBudget()

            def add(t: torch.Tensor) -> str | InlineLeaf:
                k = next(counter)
                name = f"{self.call_id}/in/{k}"
                shard.chunk_shapes[k] = t.shape
                if budget.take(t):
                    return InlineLeaf(name, t)
                put_tensor(shard.endpoint, name, t.detach(), self._left())
                return name

            request = worker_pb2.ForwardRequest(
                model=self.model,
                call_id=self.call_id,
                grad_enabled=grad_on,
                input_grad_names=[f"{self.call_id}/in/{k}" for k in self.grad_leaf_ids],
                inline_output_bytes=INLINE_BYTES,
                version=version,
                mode=self.mode,
                routed=self.routed,
                load_id=self.load_id,
                statistics_counted=self.moves_statistics and i in self.counted,
            )
            fill_value(request.args, tuple(parts_args[i]), add)
            fill_value(request.kwargs, dict(parts_kwargs[i]), add)
            return request

        def outputs_of(i: int, response: worker_pb2.ForwardResponse) -> tuple[Any, int, str]:
            self.counted.add(i)
            shard = self.shards[i]
            placement.reported(shard.endpoint.address, response.forwards_in_flight)
            placement.replicas(self.model, response.replicas_may_differ)
            self.replicas_differed = self.replicas_differed or response.replicas_may_differ
            shard.output_names = tensor_leaves(response.output)
            fetched = _decode_inline(inline_leaves(response.output))
            for n in shard.output_names:
                if n not in fetched:
                    fetched[n] = get_tensor(shard.endpoint, n, self._left(), consume=True)
            shard.outputs = [fetched[n] for n in shard.output_names]
            output = from_value(response.output, fetched.__getitem__, types)
            return output, response.version, response.load_id

        what = f"forward of {self.model!r}"

        # A shard whose inputs all travel inline is sent from this thread, every such
        # shard first, then each answer awaited; one with inputs to put first is a job.
        inline = [
            sum(t.numel() * t.element_size() for t in tensors_in((parts_args[i], parts_kwargs[i])))
            <= INLINE_BYTES
            for i in range(len(self.shards))
        ]

        def start(i: int, version: int) -> Start[tuple[Any, int, str]]:
            forward = self.shards[i].endpoint.unary("Forward")
            if inline[i]:
                return lambda: _Noted(
                    Mapped(
                        forward.future(request_of(i, version), self._left(), what),
                        lambda response: outputs_of(i, response),
                    ),
                    i,
                    failed,
                )

            return Job(
                lambda: _noting(
                    i,
                    failed,
                    lambda: outputs_of(i, forward(request_of(i, version), self._left(), what)),
                )
            )

        try:
            with placement.sending([s.endpoint.address for s in self.shards]):
                per_worker = self._run_one_version(start)
        except CollectiveError:
            _release(self.state)
            raise
        gathered = gather([per_worker[i] for i in range(len(self.shards))], self.dim)
        if not grad_on:
            self.state.finished = True  # nothing retained on the workers
            return gathered
        flat = tensors_in(gathered)
        anchor = torch.empty(0, requires_grad=True)
        weakref.finalize(self, _release, self.state)
        outs = _GatherFromWorkers.apply(self, flat, anchor, *self.grad_leaves)
        return replace_tensors(gathered, list(outs))

    def _run_one_version(
        self, start: Callable[[int, int], Start[tuple[Any, int, str]]]
    ) -> dict[int, Any]:
        """Every shard's output, all computed by one model version (then ``self.version``).

        Each shard first runs on whatever version its worker serves. A publish
        commits on every rank at one point of the op order but not at one
        instant, so shards can straddle it: those behind run again, pinned to the
        newest version seen (their worker waits for that commit, already on its
        way). A worker that meanwhile moved past it (a second publish) refuses
        with ``Reason.VERSION_MOVED``, and the whole call runs again. So does a
        call whose shards ran two loads of the model (``load_model`` by another
        client, which reaches the workers one by one, not in the op order), after
        a pause that grows with each attempt: the load is on its way."""
        what = f"data_parallel {self.model!r}"
        shards = range(len(self.shards))
        pause = _RELOAD_PAUSE_S
        for _ in range(_VERSION_ATTEMPTS):
            try:
                done = self.session.fan_out(what, {i: start(i, 0) for i in shards})
                newest = max(v for _, v, _ in done.values())
                behind = [i for i in shards if done[i][1] != newest]
                if behind:
                    done.update(self.session.fan_out(what, {i: start(i, newest) for i in behind}))
            except CollectiveError as err:
                if err.reason == Reason.VERSION_MOVED:
                    continue
                raise
            if len({load for _, _, load in done.values()}) > 1:
                if self._left() <= pause:
                    break
                threading.Event().wait(pause)  # (the load on its way to the other workers)
                pause *= 2
                continue
            self.version = newest
            return {i: value for i, (value, _, _) in done.items()}
        raise Unavailable(
            f"{what}: the model's version or load changed under every one of "
            f"{_VERSION_ATTEMPTS} attempts (publishes or reloads faster than a forward, "
            "or the ranks hold different loads of it: two load_model calls of it raced, "
            "each reaching some ranks last); retry, publish less often, or load it again"
        )

    def _raise_if_a_graph_left(self, what: str) -> None:
        """After a backward found a worker unavailable: if a worker that ran this call's
        forward is no longer a member (drained, or lost), its graph left with it, and
        only running the forward again helps: say so (FailedPrecondition)."""
        try:
            members = {w.address for w in self.session.refresh().members}
        except CollectiveError:
            return  # (the coordinator cannot say: the worker's own error stands)
        gone = [s.endpoint.address for s in self.shards if s.endpoint.address not in members]
        if gone:
            raise FailedPrecondition(
                f"{what}: the forward of this call ran on {', '.join(gone)}, which is no "
                "longer a member (drained, or lost), and its graph left with it; run the "
                "forward again"
            ) from None

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        if self.state.finished:
            raise InvalidArgument(
                f"the remote graph of this data_parallel call ({self.call_id}) was already "
                "used or released; backward through it runs once"
            )
        self.state.finished = True
        self.deadline = self.session.deadline(None)

        def slices(j: int, grad: torch.Tensor) -> list[torch.Tensor]:
            parts = [s.outputs[j] for s in self.shards]
            if all(p.dim() == 0 for p in parts):
                return [grad[i] for i in range(len(parts))]
            return list(torch.split(grad, [p.shape[self.dim] for p in parts], self.dim))

        per_leaf = [
            slices(j, g) if g is not None else [None] * len(self.shards)
            for j, g in enumerate(grads)
        ]

        what = f"backward of {self.model!r}"

        def start(i: int) -> Start[list[torch.Tensor | None]]:
            shard = self.shards[i]
            names = []
            inline = []
            to_put: list[tuple[str, torch.Tensor]] = []
            budget = InlineBudget()
            for j in range(len(shard.output_names)):
                g = per_leaf[j][i]
                if g is None or not (g.is_floating_point() or g.is_complex()):
                    names.append("")
                    continue
                name = f"{self.call_id}/grad/{j}"
                if budget.take(g):
                    inline.append(_inline(name, g))
                else:
                    to_put.append((name, g))
                names.append(name)
            request = worker_pb2.BackwardRequest(
                model=self.model,
                call_id=self.call_id,
                output_names=shard.output_names,
                grad_names=names,
                inline_grads=inline,
                inline_output_bytes=INLINE_BYTES,
            )
            backward = shard.endpoint.unary("Backward")

            def input_grads(response: worker_pb2.BackwardResponse) -> list[torch.Tensor | None]:
                came = _decode_inline(response.inline_input_grads)
                for n in response.input_grad_names:
                    if n and n not in came:
                        came[n] = get_tensor(shard.endpoint, n, self._left(), consume=True)
                return [came[n] if n else None for n in response.input_grad_names]

            if not to_put:  # every gradient travels inline: sent from this thread
                return lambda: Mapped(backward.future(request, self._left(), what), input_grads)

            def put_then_call() -> list[torch.Tensor | None]:
                for name, g in to_put:
                    put_tensor(shard.endpoint, name, g.contiguous(), self._left())
                return input_grads(backward(request, self._left(), what))

            return Job(put_then_call)

        try:
            per_worker = self.session.fan_out(what, {i: start(i) for i in range(len(self.shards))})
        except CollectiveError as err:
            # A shard whose backward never ran (its deadline passed first) still holds
            # its graph, which would block publishes until --graph-ttl-s: drop them.
            self.state.finished = False
            _release(self.state)
            if isinstance(err, Unavailable):
                self._raise_if_a_graph_left(what)
            raise
        result: list[torch.Tensor | None] = []
        for position, k in enumerate(self.grad_leaf_ids):
            leaf = self.grad_leaves[position]
            chunks = []
            for i, shard in enumerate(self.shards):
                g = per_worker[i][position]
                chunks.append(
                    g if g is not None else torch.zeros(shard.chunk_shapes[k], dtype=leaf.dtype)
                )
            # On the input's device and in its dtype, as autograd requires of a gradient.
            result.append(torch.cat(chunks, self.dim).to(device=leaf.device, dtype=leaf.dtype))
        return result

    def _left(self) -> float:
        return time_left(self.deadline, f"model {self.model!r}")


class _GatherFromWorkers(torch.autograd.Function):
    """The seed's Gather with workers for devices: backward scatters grad_output back."""

    @staticmethod
    def forward(ctx, call: _RemoteCall, flat: list[torch.Tensor], anchor, *grad_inputs):
        ctx.call = call
        outs = tuple(flat)
        ctx.mark_non_differentiable(
            *(t for t in outs if not (t.is_floating_point() or t.is_complex()))
        )
        return outs

    @staticmethod
    def backward(ctx, *grads):
        input_grads = ctx.call.backward(grads)
        return (None, None, None, *input_grads)


# What nn.DataParallel has that a model on the workers cannot give locally.
_REMOTE_ONLY = frozenset(
    ("module", "parameters", "named_parameters", "buffers", "named_buffers", "state_dict")
)


class DataParallel:
    """A callable running a cluster model data-parallel, like ``torch.nn.DataParallel``.

    ``dp(*inputs, **kwargs)`` splits tensors along ``dim`` across the workers
    (a batch smaller than the world uses fewer workers, placed by load when the
    call has no autograd: ``collectives.models.placement``), runs the model on each
    worker over its local devices, and returns the outputs gathered along
    ``dim`` in order. With autograd enabled, ``loss.backward()`` runs backward
    on the workers and accumulates parameter gradients there.

    Every output is computed by one model version on every shard, and by one
    load of the model, never a mix (see ``Cluster.publish``; a call that met
    another client's ``load_model`` runs again); :attr:`last_version` says which
    version, per thread. The remote graph of a forward stays on the workers that
    ran it: a backward after one of them left the cluster (drained, or lost)
    raises ``FailedPrecondition``; run the forward again.
    """

    def __init__(
        self,
        session: Session,
        models: Models,
        name: str,
        dim: int = 0,
        timeout: float | None = None,
    ) -> None:
        self._session = session
        self._models = models
        self.name = validate_name(name, "model name")
        self.dim = dim
        self.timeout = timeout
        self._local = threading.local()
        # This callable's own mode: the model's recorded mode when first needed,
        # then whatever train()/eval() set; every call carries it.
        self._training: bool | None = None
        self._info: ModelInfo | None = None  # the model's ModelInfo, read with the mode

    @property
    def training(self) -> bool:
        """Whether this callable runs the model in train mode (dropout on, batch norm
        on each shard's statistics), as ``nn.Module.training``. It starts as the
        model's recorded mode (``ModelInfo.training``, read on first use) and is
        this callable's own from then on: another client's ``eval()`` does not
        change it.

        Raises:
            NotFound: the model is not loaded.
        """
        if self._training is None:
            self._info = self._read_info()
            self._training = self._info.training
        return self._training

    def _read_info(self) -> ModelInfo:
        """The model's ModelInfo as the cluster holds it now.

        Raises:
            NotFound: the model is not loaded.
        """
        infos = {m.name: m for m in self._models.models(timeout=self.timeout)}
        if self.name not in infos:
            raise NotFound(f"model {self.name!r} is not loaded; load_model it first")
        return infos[self.name]

    def train(self, mode: bool = True) -> DataParallel:
        """Switches this callable to train mode (``mode=False``: eval mode), and the
        model's recorded mode with it (``Cluster.set_model_mode``: what callables made
        later start with).

        Like ``nn.Module.train``: every later call of this callable runs every
        shard in that mode, whatever other callables do. In train mode a batch
        is cut so that no worker gets a shard of one row (fewer workers for a
        small batch, for a model with batch norm; see ``docs/training.md``).

        Args:
            mode: True for train mode, False for eval mode. Defaults to ``True``.

        Returns:
            ``self``.

        Raises:
            NotFound: the model is not loaded.
            FailedPrecondition: its exported graph cannot be switched (see
                ``Cluster.set_model_mode``).
        """
        info = self._models.set_model_mode(self.name, bool(mode), timeout=self.timeout)
        self._info = info
        self._training = bool(mode)
        return self

    def eval(self) -> DataParallel:
        """Switches the model to eval mode on every worker (``train(False)``).

        Returns:
            ``self``.

        Raises:
            NotFound: the model is not loaded.
            FailedPrecondition: its exported graph cannot be switched (see
                ``Cluster.set_model_mode``).
        """
        return self.train(False)

    def __getattr__(self, attr: str) -> Any:
        if attr in _REMOTE_ONLY:
            raise AttributeError(
                f"DataParallel has no {attr!r}: the model {self.name!r} lives on the workers, "
                f"not in this process. Its weights: cluster.state_dict({self.name!r}); "
                f"its gradients: cluster.gradients({self.name!r}); an optimizer step: "
                f"cluster.step({self.name!r}, ...); its info: cluster.models()"
            )
        raise AttributeError(f"'DataParallel' object has no attribute {attr!r}")

    @property
    def last_version(self) -> int:
        """The model version that computed the last output this thread got from this
        callable (0 before its first call)."""
        return getattr(self._local, "version", 0)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the model on the workers: ``dp(*inputs, **kwargs)``, like ``nn.DataParallel``.

        Tensors are split along ``dim`` across the workers (a batch smaller than
        the world uses fewer workers, the least loaded), the model runs on each
        worker over its local devices, and the outputs come back gathered along
        ``dim`` in order; inputs and outputs may be nested tuples, lists, dicts
        and namedtuples. With autograd enabled, ``loss.backward()`` runs backward
        on the workers and accumulates parameter gradients there.

        Args:
            *inputs: the model's positional inputs.
            **kwargs: the model's keyword inputs.

        Returns:
            The outputs gathered along ``dim`` in worker order, all computed by one
            model version (:attr:`last_version`), in this callable's mode
            (:attr:`training`).

        Raises:
            NotFound: the model is not loaded.
            InvalidArgument: an input cannot be sent, or the model rejected the
                inputs; inputs whose number, nesting or kind differ from a loaded
                module's ``example_inputs`` are named with what it takes, e.g.
                ``model 'm' takes 1 positional input (a tensor), got 2: (tensor, tensor)``.
            Unavailable: publishes kept moving the model's version under the call
                (its shards straddled a publish 8 attempts in a row).
            CollectiveError: a worker failed or the call timed out.
        """
        training = self.training
        deadline = self._session.deadline(self.timeout)
        pause = _RELOAD_PAUSE_S
        for attempt in range(1, _VERSION_ATTEMPTS + 1):
            call = _RemoteCall(
                self._session,
                self._models,
                self.name,
                self.dim,
                self.timeout,
                training,
                self._info,
                deadline,
            )
            try:
                output = call.forward(inputs, kwargs)
            except FailedPrecondition as err:
                # Another client loaded the name again since this callable read how to
                # cut and place its calls (batch norm or not): a worker holding the new
                # load refused the call before running it. Read the model again; the
                # load may still be on its way to some workers.
                if err.reason != Reason.MODEL_RELOADED or attempt == _VERSION_ATTEMPTS:
                    raise
                if deadline - time.monotonic() <= pause:
                    raise
                threading.Event().wait(pause)  # (the load on its way to the other workers)
                pause *= 2
                self._info = self._read_info()
                continue
            self._local.version = call.version
            return output
        raise AssertionError("unreachable: the last attempt returns or raises")

    def __repr__(self) -> str:
        return f"DataParallel(model={self.name!r}, dim={self.dim})"
