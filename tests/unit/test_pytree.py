"""The seed's scatter/gather semantics, lifted to workers, and the Value round trip."""

from __future__ import annotations

import collections

import pytest
import torch

from collectives.errors import InvalidArgument
from collectives.wire.pytree import from_value, gather, scatter_kwargs, tensor_leaves, to_value

Point = collections.namedtuple("Point", ["x", "y"])


@pytest.mark.parametrize(
    ("batch", "parts", "sizes"), [(7, 3, [3, 3, 1]), (2, 3, [1, 1]), (9, 3, [3, 3, 3]), (1, 4, [1])]
)
def test_tensors_split_like_torch_chunk(batch: int, parts: int, sizes: list[int]) -> None:
    x = torch.randn(batch, 4)
    args, kwargs = scatter_kwargs((x,), {}, parts)
    assert [a[0].shape[0] for a in args] == sizes
    assert torch.equal(torch.cat([a[0] for a in args]), x)
    assert kwargs == [{} for _ in sizes]


def test_nested_structures_are_followed_and_non_tensors_duplicated() -> None:
    x, y = torch.randn(6, 2), torch.randn(6, 3)
    inputs = ({"a": x, "tag": "t"}, [y, 5], Point(x, y))
    args, kwargs = scatter_kwargs(inputs, {"scale": 2.0, "z": y}, 3)
    assert len(args) == len(kwargs) == 3
    for i, (a, k) in enumerate(zip(args, kwargs, strict=True)):
        assert torch.equal(a[0]["a"], x.chunk(3)[i]) and a[0]["tag"] == "t"
        assert torch.equal(a[1][0], y.chunk(3)[i]) and a[1][1] == 5
        assert isinstance(a[2], Point) and torch.equal(a[2].y, y.chunk(3)[i])
        assert k["scale"] == 2.0 and torch.equal(k["z"], y.chunk(3)[i])


def test_smaller_batch_uses_fewer_parts_and_pads_kwargs() -> None:
    args, kwargs = scatter_kwargs((torch.randn(2, 3),), {"flag": True}, 4)
    assert len(args) == 2 and len(kwargs) == 2  # zip truncates to the fewest chunks


def test_zero_dim_input_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="0-dim"):
        scatter_kwargs((torch.tensor(1.0),), {}, 2)


def test_gather_concatenates_in_order_and_follows_structures() -> None:
    parts = [torch.randn(2, 3), torch.randn(1, 3)]
    outs = [{"o": p, "pair": (p, Point(p, p.sum()))} for p in parts]
    with pytest.warns(UserWarning, match="unsqueeze"):
        got = gather(outs)
    assert torch.equal(got["o"], torch.cat(parts))
    assert torch.equal(got["pair"][0], torch.cat(parts))
    assert isinstance(got["pair"][1], Point)
    assert torch.equal(got["pair"][1].y, torch.stack([p.sum() for p in parts]))


def test_gather_along_another_dim_and_none() -> None:
    parts = [torch.randn(3, 2), torch.randn(3, 4)]
    assert torch.equal(gather(parts, dim=1), torch.cat(parts, 1))
    assert gather([None, None]) is None
    assert gather([3, 3]) == 3 and gather(["a", "b"]) == ["a", "b"]


def test_value_round_trip_keeps_structure_and_names_leaves() -> None:
    obj = (torch.randn(2), {"k": [torch.randn(3), None, 1.5, "s", True]}, Point(torch.randn(1), 7))
    store: dict[str, torch.Tensor] = {}

    def add(t: torch.Tensor) -> str:
        name = f"in/{len(store)}"
        store[name] = t
        return name

    value = to_value(obj, add)
    assert tensor_leaves(value) == ["in/0", "in/1", "in/2"]
    back = from_value(value, store.__getitem__, {"Point": Point})
    assert torch.equal(back[0], obj[0]) and back[1]["k"][1:] == [None, 1.5, "s", True]
    assert isinstance(back[2], Point) and back[2].y == 7


def test_unsendable_objects_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="no pickle"):
        to_value(object(), lambda t: "x")
