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
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

from collectives.errors import FailedPrecondition

__all__ = ["captured_mode", "for_mode", "is_graph"]

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
# Mode-dependent operators whose switch is not written here.
_UNHANDLED = {
    _aten.native_dropout.default,
    _aten._native_batch_norm_legit.default,
    _aten._native_batch_norm_legit_functional.default,
    _aten.native_batch_norm.default,
    _aten.rrelu_with_noise.default,
}


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
        index = _MODE_ARG.get(node.target) if node.op == "call_function" else None
        if index is not None:
            return bool(_full_args(node)[index])
    return True


def for_mode(module: nn.Module, training: bool, model: str) -> nn.Module:
    """``module`` in ``training`` mode: the module itself, switched (plain), or a
    graph that shares its parameters and buffers (captured in the other mode).

    Raises:
        FailedPrecondition: the graph holds a mode-dependent operator this
            switch does not know, so it cannot run in the other mode.
    """
    if not is_graph(module):
        module.train(training)
        return module
    if captured_mode(module) == training:
        return module
    graph = copy.deepcopy(module.graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
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
        elif node.target is _aten.instance_norm.default and node.args[3] is not None:
            args = list(node.args)
            args[5] = training  # use_input_stats: the batch's in train, the running ones in eval
            node.args = tuple(args)
        elif not training and _counts_batches(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.lint()
    switched = fx.GraphModule(module, graph)  # attributes are shared, not copied
    # The captured module's own input checks (shapes, pytree layout) run as its
    # pre-hooks, on the captured module: the switched one lacks their attributes.
    for key, hook in module._forward_pre_hooks.items():
        with_kwargs = key in module._forward_pre_hooks_with_kwargs
        switched.register_forward_pre_hook(_on(module, hook, with_kwargs), with_kwargs=with_kwargs)
    switched.train(training)
    return switched


def _on(module: nn.Module, hook: Any, with_kwargs: bool) -> Any:
    if with_kwargs:
        return lambda _switched, args, kwargs: hook(module, args, kwargs)
    return lambda _switched, args: hook(module, args)


def _full_args(node: fx.Node) -> list[Any]:
    """The node's positional arguments through its mode argument, keyword and
    default ones filled in from the operator's schema."""
    schema = node.target._schema  # type: ignore[union-attr]
    args = list(node.args)
    for argument in schema.arguments[len(args) : _MODE_ARG[node.target] + 1]:
        if argument.name in node.kwargs:
            args.append(node.kwargs[argument.name])
        else:
            args.append(argument.default_value)
    return args


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
