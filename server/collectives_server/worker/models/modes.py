"""Train and eval mode of a hosted model, like ``nn.Module.train()`` / ``eval()``.

A model built by a factory is an ``nn.Module``: its mode is switched with
``module.train(mode)``. A model loaded from a ``torch.export`` archive is a
graph captured in one mode (the mode the client's module had when it was
exported): its dropout and batch-norm calls carry that mode as an argument,
and torch refuses ``eval()`` on it. The other mode's graph is built here from
the captured one, sharing its parameters and buffers:

* ``aten.dropout`` and its feature/alpha variants, and ``aten.rrelu``: their
  ``train`` argument;
* ``aten.batch_norm``: its ``training`` argument; in eval mode the increment
  of ``num_batches_tracked`` goes (as ``nn.BatchNorm`` skips it in eval);
* ``aten.instance_norm`` with running statistics: ``use_input_stats``.

In train mode batch norm normalises each shard with the shard's own statistics
and updates that worker's running statistics, exactly as each replica of
``nn.DataParallel`` does. A graph holding another operator whose result
depends on the mode is refused (``FAILED_PRECONDITION``), never run in the
wrong mode silently.

A captured graph calls ``aten.batch_norm`` / ``aten.instance_norm`` directly,
without the checks ``torch.nn.functional`` makes first, so a train-mode graph
gets them back here: batch norm on one value per channel, or instance norm on
one spatial element, raises torch's own ``ValueError`` instead of writing NaN
into a running statistic. :func:`restoring_buffers` puts back the buffers a
failed train-mode call had already changed, so a refused call changes nothing.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

from collectives.errors import FailedPrecondition
from collectives.v1 import worker_pb2

__all__ = [
    "captured_mode",
    "for_mode",
    "is_graph",
    "keeps_running_statistics",
    "restoring_buffers",
    "snapshot_buffers",
    "training_of",
    "uses_batch_statistics",
]

_aten = torch.ops.aten
# Operator -> index of its mode argument (True: train).
_MODE_ARG: dict[Any, int] = {
    _aten.dropout.default: 2,
    _aten.feature_dropout.default: 2,
    _aten.alpha_dropout.default: 2,
    _aten.feature_alpha_dropout.default: 2,
    _aten.rrelu.default: 3,
    _aten.batch_norm.default: 5,
}
# aten.batch_norm's momentum argument.
_MOMENTUM_ARG = 6
# Mode-dependent operators whose switch is not written here.
_UNHANDLED = {
    _aten.native_dropout.default,
    _aten._native_batch_norm_legit.default,
    _aten._native_batch_norm_legit_functional.default,
    _aten.native_batch_norm.default,
    _aten.rrelu_with_noise.default,
}


_TRAINING = {worker_pb2.MODEL_MODE_TRAIN: True, worker_pb2.MODEL_MODE_EVAL: False}


def training_of(mode: int) -> bool | None:
    """A wire ``ModelMode`` as ``training`` (None: unspecified)."""
    return _TRAINING.get(mode)


def is_graph(module: nn.Module) -> bool:
    """Whether ``module`` is a captured graph (from an export archive)."""
    return isinstance(module, fx.GraphModule)


def captured_mode(module: nn.Module) -> bool:
    """The mode ``module`` runs in as it is: ``module.training`` for a plain module;
    for a graph, the mode its dropout / batch-norm calls were captured in (train
    when it holds none: it then computes the same in both)."""
    if not is_graph(module):
        return module.training
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        index = _MODE_ARG.get(node.target)
        if index is not None:
            return bool(_full_args(node)[index])
        if node.target is _aten.instance_norm.default and node.args[3] is not None:
            return bool(node.args[5])  # use_input_stats: the batch's only in train mode
    return True


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether ``module`` in train mode normalises over the batch (batch norm), so a
    shard of one row is one it cannot run."""
    if is_graph(module):
        return any(
            n.op == "call_function" and n.target is _aten.batch_norm.default
            for n in module.graph.nodes
        )
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def keeps_running_statistics(module: nn.Module) -> bool:
    """Whether a train-mode call writes ``module``'s buffers on the worker that runs it:
    running statistics of a batch norm or an instance norm that tracks them, or (in
    a graph) any buffer an in-place operator writes. Each worker's replica then holds
    what its own shards moved, so its answers depend on which worker ran them."""
    if not is_graph(module):
        return any(
            isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm))
            and getattr(m, "running_mean", None) is not None
            for m in module.modules()
        )
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (_aten.batch_norm.default, _aten.instance_norm.default):
            if node.args[3] is not None:  # running_mean
                return True
        elif _writes_a_buffer(node):
            return True
    return False


def _writes_a_buffer(node: fx.Node) -> bool:
    """An in-place operator whose first argument is one of the graph's attributes."""
    schema = getattr(node.target, "_schema", None)
    target = node.args[0] if node.args else None
    return (
        schema is not None
        and schema.is_mutable
        and isinstance(target, fx.Node)
        and target.op == "get_attr"
    )


def for_mode(module: nn.Module, training: bool, model: str) -> nn.Module:
    """``module`` in ``training`` mode: the module itself, switched (plain), or a
    graph that shares its parameters and buffers (captured in the other mode, or
    given back torch's input checks for train mode); the captured graph itself
    when nothing changes.

    Raises:
        FailedPrecondition: the graph holds a mode-dependent operator this
            switch does not know, so it cannot run in the other mode.
    """
    if not is_graph(module):
        module.train(training)
        return module
    switch = captured_mode(module) != training
    if not switch and not (training and any(map(_needs_check, module.graph.nodes))):
        return module
    graph = copy.deepcopy(module.graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if switch:
            _switch(module, graph, node, training, model)
        if training and _needs_check(node):
            batch = node.target is _aten.batch_norm.default
            with graph.inserting_before(node):
                graph.call_function(_verify_batch if batch else _verify_spatial, (node.args[0],))
    graph.lint()
    switched = fx.GraphModule(module, graph)  # attributes are shared, not copied
    # The captured module's own input checks (shapes, pytree layout) run as its
    # pre-hooks, on the captured module: the switched one lacks their attributes.
    for key, hook in module._forward_pre_hooks.items():
        with_kwargs = key in module._forward_pre_hooks_with_kwargs
        switched.register_forward_pre_hook(_on(module, hook, with_kwargs), with_kwargs=with_kwargs)
    switched.train(training)
    return switched


def _switch(owner: nn.Module, graph: fx.Graph, node: fx.Node, training: bool, model: str) -> None:
    """Rewrites ``node`` (a call) to compute what it computes in ``training`` mode."""
    if node.target in _UNHANDLED:
        raise FailedPrecondition(
            f"model {model!r} cannot run in {'train' if training else 'eval'} mode: its "
            f"exported graph calls {node.target}, whose result depends on the mode, in "
            "a form this worker cannot switch; export the model in the mode you will run"
        )
    index = _MODE_ARG.get(node.target)
    if index is not None:
        args = _full_args(node)
        args[index] = training
        positional = {a.name for a in node.target._schema.arguments[: len(args)]}
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in positional}
        node.args = tuple(args)
        if training and node.target is _aten.batch_norm.default:
            _refuse_a_cumulative_average(node, model)
            _count_batches(owner, graph, node)
    elif node.target is _aten.instance_norm.default and node.args[3] is not None:
        args = list(node.args)
        args[5] = training  # use_input_stats: the batch's in train, the running ones in eval
        node.args = tuple(args)
    elif not training and _counts_batches(node):
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)


def _refuse_a_cumulative_average(batch_norm: fx.Node, model: str) -> None:
    """A batch norm captured in eval mode holds momentum 0.0 both when its module's
    momentum was 0.0 and when it was None (a cumulative average, whose factor
    changes with each batch): the graph cannot tell which to update with in train
    mode, so it is not trained here rather than trained wrong."""
    momentum = _full_args(batch_norm, _MOMENTUM_ARG)[_MOMENTUM_ARG]
    if batch_norm.args[3] is not None and momentum == 0.0:
        raise FailedPrecondition(
            f"model {model!r} cannot run in train mode: it was exported in eval mode with "
            "a batch norm whose momentum is None (a cumulative average) or 0.0, which its "
            "graph does not tell apart; load it with a factory, or give the batch norm a "
            "momentum, to train it on the workers"
        )


def _needs_check(node: fx.Node) -> bool:
    """Whether ``node`` normalises over its input's own statistics in train mode: a
    batch norm, or an instance norm (train mode uses the input's statistics)."""
    return node.op == "call_function" and node.target in (
        _aten.batch_norm.default,
        _aten.instance_norm.default,
    )


def _verify_batch(x: torch.Tensor) -> None:
    """torch.nn.functional.batch_norm's check in train mode."""
    values = x.shape[0] if x.dim() else 1
    for d in x.shape[2:]:
        values *= d
    if values == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {x.size()}"
        )


def _verify_spatial(x: torch.Tensor) -> None:
    """torch.nn.functional.instance_norm's check when it uses the input's statistics."""
    values = 1
    for d in x.shape[2:]:
        values *= d
    if values == 1:
        raise ValueError(
            f"Expected more than 1 spatial element when training, got input size {x.size()}"
        )


@contextlib.contextmanager
def restoring_buffers(module: nn.Module, training: bool, always: bool = False) -> Iterator[None]:
    """Runs the body; if it raises in ``training`` mode (or ends at all, ``always``), the
    module's buffers (batch norm's running statistics and batch count) are put back as
    they were, so a refused train-mode call leaves no trace. Eval mode changes no
    buffer: no copy."""
    if not training:
        yield
        return
    restore = snapshot_buffers(module)
    try:
        yield
    except BaseException:
        restore()
        raise
    if always:
        restore()


def snapshot_buffers(module: nn.Module) -> Callable[[], None]:
    """A copy of the module's buffers now; calling the result puts them back."""
    kept = [(b, b.detach().clone()) for b in module.buffers()]

    def restore() -> None:
        with torch.no_grad():
            for buffer, before in kept:
                buffer.copy_(before)

    return restore


def _on(module: nn.Module, hook: Any, with_kwargs: bool) -> Any:
    if with_kwargs:
        return lambda _switched, args, kwargs: hook(module, args, kwargs)
    return lambda _switched, args: hook(module, args)


def _full_args(node: fx.Node, through: int | None = None) -> list[Any]:
    """The node's positional arguments through its mode argument (or index
    ``through``), keyword and default ones filled in from the operator's schema."""
    schema = node.target._schema  # type: ignore[union-attr]
    args = list(node.args)
    last = _MODE_ARG[node.target] if through is None else through
    for argument in schema.arguments[len(args) : last + 1]:
        if argument.name in node.kwargs:
            args.append(node.kwargs[argument.name])
        else:
            args.append(argument.default_value)
    return args


def _count_batches(owner: nn.Module, graph: fx.Graph, batch_norm: fx.Node) -> None:
    """Before ``batch_norm`` (switched to train mode), ``num_batches_tracked += 1`` of
    its module, as nn.BatchNorm counts in train mode: a graph captured in eval mode
    holds no such increment, only the buffer."""
    running_mean = batch_norm.args[3]
    if not isinstance(running_mean, fx.Node) or running_mean.op != "get_attr":
        return
    prefix = str(running_mean.target).removesuffix("running_mean")
    target = f"{prefix}num_batches_tracked"
    if prefix == str(running_mean.target):
        return
    try:
        owner.get_buffer(target)
    except AttributeError:
        return  # a batch norm that tracks no batch count
    counter = next((n for n in graph.nodes if n.op == "get_attr" and n.target == target), None)
    with graph.inserting_before(batch_norm):
        if counter is None:
            counter = graph.get_attr(target)
        graph.call_function(_aten.add_.Tensor, (counter, 1))


def _counts_batches(node: fx.Node) -> bool:
    """``num_batches_tracked += 1`` of a batch norm (train mode only)."""
    if node.target is not _aten.add_.Tensor:
        return False
    target = node.args[0]
    return (
        isinstance(target, fx.Node)
        and target.op == "get_attr"
        and str(target.target).endswith("num_batches_tracked")
    )
