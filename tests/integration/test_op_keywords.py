"""Every collective takes the same keywords: generated from the op spec table.

For each public collective (the op spec table's data collectives, by the name
the SDK gives them) x sync / async x the whole world / a sub-group x one name /
a list of names x ``out`` absent / given, the call either does what torch
computes on the same inputs, or is refused with ``InvalidArgument`` saying
why. Never a ``TypeError``, never a keyword silently ignored. Runs on the
shared 3-worker cluster, with the sub-group {0, 2}.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import get_each, put_each

from collectives import InvalidArgument
from collectives.wire.op_specs import COALESCED_BASE, SPECS, Operand, Stores, spec

TIMEOUT_S = 30.0
ROWS = 2  # rows per member in each input's dim 0 (reduce_scatter, all_to_all split it)

# The public method of each data-collective spec (send and exchange share one kind).
PUBLIC = {
    "broadcast": "broadcast",
    "all_reduce": "all_reduce",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "gather": "gather",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "all_to_all",
    "barrier": "barrier",
    "exchange": "exchange",
}
# Which take a list of names (one atomic op): their coalesced kinds are in the table.
COALESCED = {spec(base).name for base in COALESCED_BASE.values()}


def _ops() -> list[str]:
    names = [s.name for s in SPECS.values() if s.name in PUBLIC]
    assert set(names) == set(PUBLIC), "a collective in the table has no case here"
    return sorted(names)


@dataclass
class Case:
    op: str
    async_op: bool
    grouped: bool
    listed: bool
    with_out: bool

    @property
    def id(self) -> str:
        return "-".join(
            [
                self.op,
                "async" if self.async_op else "sync",
                "group" if self.grouped else "world",
                "list" if self.listed else "one",
                "out" if self.with_out else "inplace",
            ]
        )


def _cases() -> list[Case]:
    out = []
    for op, async_op, grouped, listed, with_out in itertools.product(
        _ops(), (False, True), (False, True), (False, True), (False, True)
    ):
        if op == "barrier" and (listed or with_out):
            continue  # no name, no result
        out.append(Case(op, async_op, grouped, listed, with_out))
    return out


def _refusal(case: Case) -> str | None:
    """The words of the InvalidArgument a case must get, or None when it must work."""
    if case.listed and case.op not in COALESCED:
        return "takes one name"
    if case.op == "broadcast" and case.with_out:
        return "works in place"
    return None


def _expected(case: Case, members: list[int], inputs: list[torch.Tensor]) -> dict[int, Any]:
    """What each member stores under the result name, computed by torch."""
    size = len(members)
    mine = [inputs[r] for r in members]
    if case.op == "broadcast":
        return dict.fromkeys(members, mine[-1])
    if case.op == "all_reduce":
        return dict.fromkeys(members, torch.stack(mine).sum(0))
    if case.op == "reduce":
        return {members[0]: torch.stack(mine).sum(0)}
    if case.op == "all_gather":
        return dict.fromkeys(members, torch.stack(mine))
    if case.op == "gather":
        return {members[0]: torch.stack(mine)}
    if case.op == "reduce_scatter":
        total = torch.stack(mine).sum(0)
        return {r: total.chunk(size)[i] for i, r in enumerate(members)}
    if case.op == "all_to_all":
        return {
            r: torch.cat([mine[i].chunk(size)[j] for i in range(size)])
            for j, r in enumerate(members)
        }
    if case.op == "exchange":
        return {members[1]: mine[0], members[0]: mine[1]}
    raise AssertionError(case.op)


def _call(cluster, case: Case, group, members, names: Any, outs: Any) -> Any:
    kw: dict[str, Any] = {"async_op": case.async_op, "timeout": TIMEOUT_S, "group": group}
    if case.with_out:
        kw["out"] = outs
    fn: Callable[..., Any] = getattr(cluster, PUBLIC[case.op])
    if case.op == "broadcast":
        return fn(names, src=members[-1], **kw)
    if case.op in ("reduce", "gather"):
        return fn(names, dst=members[0], **kw)
    if case.op == "exchange":
        return fn(names, pairs=[(members[0], members[1]), (members[1], members[0])], **kw)
    if case.op == "barrier":
        return fn(**kw)
    return fn(names, **kw)


@pytest.fixture(scope="module")
def subgroup(cluster3):
    """One sub-group for the module (a worker holds a bounded number of groups)."""
    group = cluster3.new_group([0, 2], timeout=TIMEOUT_S)
    yield group
    cluster3.destroy_group(group, timeout=TIMEOUT_S)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_every_op_takes_the_same_keywords(cluster3, subgroup, gen, uname, case: Case) -> None:
    cluster = cluster3
    members = list(subgroup.ranks) if case.grouped else list(range(cluster.world_size))
    group = subgroup if case.grouped else None
    count = 2 if case.listed else 1
    names = [uname(f"in{i}") for i in range(count)]
    outs = [uname(f"out{i}") for i in range(count)]
    inputs = {
        n: [torch.randn(ROWS * len(members), 3, generator=gen) for _ in range(cluster.world_size)]
        for n in names
    }
    for n in names:
        put_each(cluster, n, inputs[n])
    arg_names = names if case.listed else names[0]
    arg_outs = outs if case.listed else outs[0]

    words = _refusal(case)
    if words is not None:
        with pytest.raises(InvalidArgument, match=words):
            _call(cluster, case, group, members, arg_names, arg_outs)
        return
    result = _call(cluster, case, group, members, arg_names, arg_outs)
    if case.async_op:
        result = result.result(TIMEOUT_S)
    if case.op == "barrier":
        return
    rules = next(s for s in SPECS.values() if s.name == case.op)
    for n, o in zip(names, outs, strict=True):
        target = o if case.with_out else n
        expected = _expected(case, members, inputs[n])
        got = get_each(cluster, target, sorted(expected))
        for rank, tensor in zip(sorted(expected), got, strict=True):
            torch.testing.assert_close(tensor, expected[rank], msg=f"{case.id} rank {rank}")
        if rules.operand is not Operand.NONE and rules.stores is Stores.ROOT:
            # reduce and gather also return the root's result
            returned = result if case.op == "reduce" else torch.stack(result)
            torch.testing.assert_close(returned, expected[members[0]])


@pytest.mark.parametrize("grouped", [False, True], ids=["world", "group"])
def test_scatter_takes_async_op(cluster3, subgroup, gen, uname, grouped: bool) -> None:
    cluster = cluster3
    members = list(subgroup.ranks) if grouped else list(range(cluster.world_size))
    name = uname("sc")
    t = torch.randn(2 * len(members), 3, generator=gen)
    work = cluster.scatter(
        name, t, group=subgroup if grouped else None, async_op=True, timeout=TIMEOUT_S
    )
    assert work.result(TIMEOUT_S) is None
    parts = torch.tensor_split(t, len(members))
    for rank, got in zip(members, get_each(cluster, name, members), strict=True):
        torch.testing.assert_close(got, parts[members.index(rank)])
