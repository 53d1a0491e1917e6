"""What an exported model takes, set beside what a call gave it, in the caller's terms.

An exported program checks a call's inputs against the input tree spec it was
exported with; torch's message for a mismatch prints both ``TreeSpec`` reprs
over several lines, and a worker's error keeps one line of a backend message,
so the caller read only "Trying to flatten user inputs with exported input
tree spec:". :func:`inputs_mismatch` says instead, e.g., ``model 'm' takes 1
positional input (a tensor), got 2: (tensor, tensor)``.

It runs only after the model failed (no cost to a call that works), and says
something only when the call's structure differs from the program's: the
number, nesting or kind of the inputs, or their keywords.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._pytree import TreeSpec

__all__ = ["inputs_mismatch"]

# Longest description of either side kept in a message (a call with a huge dict).
_MAX_TEXT = 400


def _kind(value: object) -> str:
    """A leaf as the caller knows it: ``tensor``, ``int``, ``None``..."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "None" if value is None else type(value).__name__


def _value_text(value: object) -> str:
    """``value``'s structure, its leaves by kind: ``{'x': tensor, 'y': (tensor, int)}``."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return f"{type(value).__name__}({', '.join(_value_text(v) for v in value)})"
    if isinstance(value, tuple):
        inner = ", ".join(_value_text(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return f"[{', '.join(_value_text(v) for v in value)}]"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{k!r}: {_value_text(v)}" for k, v in items) + "}"
    return _kind(value)


def _children(spec: TreeSpec) -> list[TreeSpec]:
    """``spec``'s child specs (``children()`` in newer torch, ``children_specs`` before)."""
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def _spec_text(spec: TreeSpec, leaves: Iterator[str]) -> str:
    """``spec``'s structure in the notation of :func:`_value_text`, leaves from ``leaves``."""
    if spec.is_leaf():
        return next(leaves, "input")
    parts = [_spec_text(child, leaves) for child in _children(spec)]
    kind = spec.type
    if kind is type(None):
        return "None"
    if kind is dict or (isinstance(kind, type) and issubclass(kind, dict)):
        keyed = sorted(zip(spec.context, parts, strict=True), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in keyed) + "}"
    if kind is list:
        return f"[{', '.join(parts)}]"
    if kind is tuple:
        return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"
    return f"{getattr(kind, '__name__', 'object')}({', '.join(parts)})"


def _leaf_kinds(module: nn.Module, count: int) -> list[str]:
    """The kind of each of the program's ``count`` inputs, from its graph's placeholders
    (the flattened user inputs); ``input`` for each when they do not line up."""
    graph = getattr(module, "graph", None)
    nodes = [] if graph is None else [n for n in graph.nodes if n.op == "placeholder"]
    if len(nodes) != count:
        return ["input"] * count
    return [_kind(n.meta.get("val")) if "val" in n.meta else "input" for n in nodes]


def _cap(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def _inputs_wanted(module: nn.Module, spec: TreeSpec) -> tuple[list[str], dict[str, str]] | None:
    """Each positional input's text and each keyword's, as the program takes them."""
    if spec.type is not tuple or spec.num_children != 2:
        return None
    args_spec, kwargs_spec = _children(spec)
    if args_spec.type is not tuple or kwargs_spec.type is not dict:
        return None
    leaves = iter(_leaf_kinds(module, spec.num_leaves))
    positional = [_spec_text(child, leaves) for child in _children(args_spec)]
    keywords = {
        str(k): _spec_text(child, leaves)
        for k, child in zip(kwargs_spec.context, _children(kwargs_spec), strict=True)
    }
    return positional, keywords


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _keywords_text(keywords: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(keywords.items()))


def inputs_mismatch(name: str, args: tuple, kwargs: dict, *modules: nn.Module) -> str | None:
    """What the exported program takes and what ``(args, kwargs)`` gave it, when their
    structures differ; None when they agree (or no module is an exported program),
    so the backend's own message stands.

    ``modules``: the module called, then the one it was made from (a graph switched
    to the other mode does not carry the captured graph's input spec).
    """
    module = next((m for m in modules if isinstance(getattr(m, "_in_spec", None), TreeSpec)), None)
    if module is None:
        return None
    spec = module._in_spec
    wanted = _inputs_wanted(module, spec)
    if wanted is None:
        return None
    positional, keywords = wanted
    got_positional = [_value_text(a) for a in args]
    got_keywords = {str(k): _value_text(v) for k, v in kwargs.items()}
    if (positional, keywords) == (got_positional, got_keywords):
        return None
    takes = _plural(len(positional), "positional input")
    if len(positional) == 1 and positional[0] == "tensor":
        takes += " (a tensor)"
    elif positional:
        takes += f" ({', '.join(positional)})"
    if keywords:
        takes += f" and {_plural(len(keywords), 'keyword input')} {_keywords_text(keywords)}"
    elif got_keywords:
        takes += " and no keyword inputs"
    got = f"{len(got_positional)}: ({', '.join(got_positional)})" if got_positional else "none"
    if got_keywords:
        got += f" and keywords {_keywords_text(got_keywords)}"
    return (
        f"model {name!r} takes {_cap(takes)}, got {_cap(got)}; an exported model takes "
        "inputs of the form of the example_inputs it was loaded with"
    )
