"""The seed's scatter/gather of nested inputs and outputs, lifted from devices to workers.

``scatter_kwargs`` splits every tensor along ``dim`` with ``torch.chunk`` (so a
batch of 7 over 3 workers is 3, 3, 1 and a batch of 2 over 3 workers uses 2),
follows tuples, lists, dicts and namedtuples, and duplicates everything else,
exactly as ``torch.nn.parallel.scatter_gather`` does for devices. ``gather``
concatenates per-worker outputs along ``dim`` in worker order, with the seed's
handling of nested outputs and of 0-dim outputs (unsqueezed, with a warning).
With ``min_rows=2`` (a train-mode call) it uses as many workers as keep every
chunk at two rows or more (7 rows over 3 workers: 4, 3), so no batch norm
ever sees a one-row shard that the caller's batch did not have.
``to_value``/``from_value`` turn those structures into the wire's ``Value``,
with tensor leaves travelling separately as named tensors.
"""

from __future__ import annotations

import collections
import keyword
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from collectives.errors import InvalidArgument
from collectives.v1 import worker_pb2
from collectives.wire.codec import write_tensor

__all__ = [
    "replace_tensors",
    "tensors_in",
    "scatter_kwargs",
    "chunk_parts",
    "gather",
    "to_value",
    "fill_value",
    "InlineLeaf",
    "from_value",
    "is_namedtuple",
    "namedtuple_class",
    "MAX_NAMEDTUPLE_TYPES",
    "MAX_NAMEDTUPLE_FIELDS",
    "tensor_leaves",
    "inline_leaves",
    "leaf_values",
]


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _scatter(obj: Any, parts: int, dim: int) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise InvalidArgument(
                "cannot scatter a 0-dim tensor input along a dimension; give it a batch dimension"
            )
        return list(torch.chunk(obj, parts, dim))
    if is_namedtuple(obj):
        return [
            type(obj)(*args) for args in zip(*(_scatter(o, parts, dim) for o in obj), strict=False)
        ]
    if isinstance(obj, tuple) and obj:
        return list(zip(*(_scatter(o, parts, dim) for o in obj), strict=False))
    if isinstance(obj, list) and obj:
        return [list(i) for i in zip(*(_scatter(o, parts, dim) for o in obj), strict=False)]
    if isinstance(obj, dict) and obj:
        return [
            type(obj)(i)
            for i in zip(*(_scatter(kv, parts, dim) for kv in obj.items()), strict=False)
        ]
    return [obj for _ in range(parts)]


def chunk_parts(rows: int, parts: int, min_rows: int = 1) -> int:
    """The most chunks, at most ``parts``, that ``torch.chunk`` cuts ``rows`` rows into
    with every chunk holding at least ``min_rows`` rows (1 when none can)."""
    for k in range(max(parts, 1), 1, -1):
        size = -(-rows // k)  # torch.chunk's chunk size
        count = -(-rows // size) if size else 0
        if count and size >= min_rows and rows - size * (count - 1) >= min_rows:
            return k
    return 1


def scatter_kwargs(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    parts: int,
    dim: int = 0,
    min_rows: int = 1,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Per-worker (args, kwargs); fewer than ``parts`` when the batch is smaller.

    The number of parts is the number of chunks the tensors split into (the
    seed would also pad with empty calls when a kwarg is not a tensor; a
    remote worker with nothing to compute is better left out), and no more
    than keeps every chunk at ``min_rows`` rows or more.
    """
    leaves = tensors_in((inputs, kwargs))
    if leaves and min_rows > 1:
        rows = min((t.shape[dim] for t in leaves if t.dim() > dim), default=0)
        parts = chunk_parts(rows, parts, min_rows)
    if leaves:
        parts = min(len(torch.chunk(t, parts, dim)) if t.dim() else parts for t in leaves)
    scattered_inputs = _scatter(inputs, parts, dim) if inputs else []
    scattered_kwargs = _scatter(kwargs, parts, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(scattered_inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    if not scattered_inputs and not scattered_kwargs:
        return [()], [{}]
    return [tuple(i) for i in scattered_inputs], [dict(k) for k in scattered_kwargs]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensor leaves of nested tuples, lists and dicts, in ``to_value`` order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def replace_tensors(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """``obj`` with its tensor leaves replaced, in order, by ``leaves`` (consumed)."""
    if isinstance(obj, torch.Tensor):
        return leaves.pop(0)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(replace_tensors(o, leaves) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(replace_tensors(o, leaves) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, replace_tensors(v, leaves)) for k, v in obj.items())
    return obj


def gather(outputs: list[Any], dim: int = 0) -> Any:
    """Combines per-worker outputs (worker order) like the seed's ``gather``."""
    out = outputs[0]
    if isinstance(out, torch.Tensor):
        if all(t.dim() == 0 for t in outputs):
            warnings.warn(
                "Was asked to gather along dimension 0, but all input tensors were scalars; "
                "will instead unsqueeze and return a vector.",
                stacklevel=3,
            )
            return torch.stack(outputs)
        return torch.cat(outputs, dim)
    if out is None:
        return None
    if isinstance(out, dict):
        if not all(len(out) == len(d) for d in outputs):
            raise ValueError("All dicts must have the same number of keys")
        return type(out)((k, gather([d[k] for d in outputs], dim)) for k in out)
    if is_namedtuple(out):
        return type(out)._make(
            map(lambda parts: gather(list(parts), dim), zip(*outputs, strict=False))
        )
    if isinstance(out, (tuple, list)):
        return type(out)(gather(list(parts), dim) for parts in zip(*outputs, strict=False))
    # Numbers and strings: one value if every worker agrees, else one per worker.
    return out if all(o == out for o in outputs) else list(outputs)


# Namedtuple classes rebuilt from the wire, least recently used first. Bounded in
# count and in size: each class is a few KiB per field and lives until evicted, so
# an unbounded cache keyed on client-chosen names and fields grows forever.
MAX_NAMEDTUPLE_TYPES = 256
MAX_NAMEDTUPLE_FIELDS = 256
MAX_NAME_CHARS = 128
_NAMEDTUPLES: collections.OrderedDict[tuple[str, tuple[str, ...]], type] = collections.OrderedDict()
_NAMEDTUPLES_LOCK = threading.Lock()


def _check_identifier(name: str, what: str, *, underscore: bool = False) -> None:
    """``name`` can name a namedtuple's type (``underscore``: may start with one) or field."""
    if len(name) > MAX_NAME_CHARS:
        raise InvalidArgument(
            f"namedtuple {what} of {len(name)} characters; at most {MAX_NAME_CHARS} allowed"
        )
    if not name.isidentifier() or keyword.iskeyword(name):
        raise InvalidArgument(f"namedtuple {what} {name!r} is not a valid Python identifier")
    if name.startswith("_") and not underscore:
        raise InvalidArgument(f"namedtuple {what} {name!r} starts with an underscore")


def namedtuple_class(type_name: str, fields: tuple[str, ...]) -> type:
    """The (cached) namedtuple class for a wire type; :class:`InvalidArgument` when the
    name or fields could not name a Python namedtuple or exceed the bounds."""
    if len(fields) > MAX_NAMEDTUPLE_FIELDS:
        raise InvalidArgument(
            f"namedtuple {type_name[:MAX_NAME_CHARS]!r} has {len(fields)} fields; at most "
            f"{MAX_NAMEDTUPLE_FIELDS} allowed"
        )
    key = (type_name, fields)
    with _NAMEDTUPLES_LOCK:
        cls = _NAMEDTUPLES.get(key)
        if cls is not None:
            _NAMEDTUPLES.move_to_end(key)
            return cls
    _check_identifier(type_name, "type name", underscore=True)
    for f in fields:
        _check_identifier(f, "field name")
    if len(set(fields)) != len(fields):
        raise InvalidArgument(f"namedtuple {type_name!r} repeats a field name")
    cls = collections.namedtuple(type_name, fields)  # type: ignore[misc]
    with _NAMEDTUPLES_LOCK:
        _NAMEDTUPLES[key] = cls
        _NAMEDTUPLES.move_to_end(key)
        while len(_NAMEDTUPLES) > MAX_NAMEDTUPLE_TYPES:
            _NAMEDTUPLES.popitem(last=False)
    return cls


@dataclass(frozen=True, slots=True)
class InlineLeaf:
    """A tensor leaf that travels in the message itself, under ``name``."""

    name: str
    tensor: torch.Tensor


AddTensor = Callable[[torch.Tensor], "str | InlineLeaf"]


def to_value(obj: Any, add_tensor: AddTensor) -> worker_pb2.Value:
    """``obj`` as a wire Value; ``add_tensor`` names each tensor leaf (and uploads
    it), or returns it as an :class:`InlineLeaf` to carry in the message."""
    value = worker_pb2.Value()
    fill_value(value, obj, add_tensor)
    return value


def fill_value(value: worker_pb2.Value, obj: Any, add_tensor: AddTensor) -> None:
    """Writes ``obj`` into ``value`` (a field of the message being built) in place.

    Building a message bottom-up copies every submessage into its parent, an
    inline tensor's bytes once per level; filling in place writes them once.
    """
    if isinstance(obj, torch.Tensor):
        leaf = add_tensor(obj)
        if isinstance(leaf, InlineLeaf):
            inline = value.inline_tensor
            inline.name = leaf.name
            write_tensor(inline.tensor, leaf.tensor)
        else:
            value.tensor = leaf
    elif obj is None:
        value.none = True
    elif isinstance(obj, bool):
        value.bool_value = obj
    elif isinstance(obj, int):
        value.int_value = obj
    elif isinstance(obj, float):
        value.float_value = obj
    elif isinstance(obj, str):
        value.str_value = obj
    elif is_namedtuple(obj):
        nt = value.named_tuple
        nt.type_name = type(obj).__name__
        nt.fields.extend(obj._fields)
        for v in obj:
            fill_value(nt.values.add(), v, add_tensor)
    elif isinstance(obj, (tuple, list)):
        items = value.tuple if isinstance(obj, tuple) else value.list
        items.SetInParent()  # an empty sequence is still a sequence
        for v in obj:
            fill_value(items.items.add(), v, add_tensor)
    elif isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise InvalidArgument("dict inputs need str keys to travel to the workers")
        d = value.dict
        d.SetInParent()
        d.keys.extend(obj)
        for v in obj.values():
            fill_value(d.values.add(), v, add_tensor)
    else:
        raise InvalidArgument(
            f"cannot send a {type(obj).__name__} to the workers: inputs must be tensors, "
            "numbers, strings, None, or tuples/lists/dicts/namedtuples of them (no pickle on "
            "the wire)"
        )


def from_value(
    value: worker_pb2.Value,
    tensor: Callable[[str], torch.Tensor],
    namedtuple_types: dict[str, type] | None = None,
) -> Any:
    """Rebuilds a structure; ``namedtuple_types`` maps type names to the caller's classes."""
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        return tensor(value.tensor)
    if kind == "inline_tensor":  # the receiver resolves it by name like a stored one
        return tensor(value.inline_tensor.name)
    if kind in ("int_value", "float_value", "str_value", "bool_value"):
        return getattr(value, kind)
    if kind == "none" or kind is None:
        return None
    if kind == "list":
        return [from_value(v, tensor, namedtuple_types) for v in value.list.items]
    if kind == "tuple":
        return tuple(from_value(v, tensor, namedtuple_types) for v in value.tuple.items)
    if kind == "dict":
        if len(value.dict.keys) != len(value.dict.values):
            raise InvalidArgument("malformed dict value: keys and values differ in length")
        return {
            k: from_value(v, tensor, namedtuple_types)
            for k, v in zip(value.dict.keys, value.dict.values, strict=True)
        }
    if kind != "named_tuple":
        raise InvalidArgument(f"unsupported value kind {kind!r}")
    nt = value.named_tuple
    fields = tuple(nt.fields)
    cls = (namedtuple_types or {}).get(nt.type_name)
    if len(nt.values) != len(fields):
        raise InvalidArgument(
            f"malformed namedtuple value: {len(fields)} fields but {len(nt.values)} values"
        )
    if cls is None or tuple(getattr(cls, "_fields", ())) != fields:
        cls = namedtuple_class(nt.type_name, fields)
    return cls(*(from_value(v, tensor, namedtuple_types) for v in nt.values))


def tensor_leaves(value: worker_pb2.Value) -> list[str]:
    """Tensor names in a Value (stored or inline), depth first (the order gather
    flattens them in)."""
    return [
        leaf.tensor if leaf.HasField("tensor") else leaf.inline_tensor.name
        for leaf in leaf_values(value)
    ]


def inline_leaves(value: worker_pb2.Value) -> list[worker_pb2.InlineTensor]:
    """The inline tensors in a Value, depth first."""
    return [leaf.inline_tensor for leaf in leaf_values(value) if leaf.HasField("inline_tensor")]


def leaf_values(value: worker_pb2.Value) -> list[worker_pb2.Value]:
    """The tensor leaves (``tensor`` or ``inline_tensor``) of a Value, depth first."""
    kind = value.WhichOneof("kind")
    if kind in ("tensor", "inline_tensor"):
        return [value]
    children: list[worker_pb2.Value] = []
    if kind in ("list", "tuple"):
        children = list(getattr(value, kind).items)
    elif kind == "dict":
        children = list(value.dict.values)
    elif kind == "named_tuple":
        children = list(value.named_tuple.values)
    return [leaf for child in children for leaf in leaf_values(child)]
