"""The ``exchange`` and ``destroy_group`` handlers on N threads over the fake process
group (``handler_world``), the fake's point to point, and ``op_args.check_pairs``.

Every source holds its own fresh random tensor (dtypes and shapes differ per
rank); each dst must end up holding its src's tensor bit for bit, the ranks in
no pair untouched, and the calls made show the path: the operand exchange, the
sends and receives on the group's data world, then the outcome agreement.
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
import torch
from fake_pg import FakeWorld, run_ranks
from handler_world import EXCHANGE, TIMEOUT_S, Cluster
from helpers import make_input

from collectives.errors import CollectiveError, InvalidArgument
from collectives.v1 import worker_pb2
from collectives.wire.op_args import check_pairs
from collectives.wire.op_specs import OpKind
from collectives_server.worker.data.replaced_memory import ReplacedMemory
from collectives_server.worker.engine.handlers.group_ops import missing_group
from collectives_server.worker.engine.op_context import Announcement, GroupBroken, OpResult

Pairs = list[tuple[int, int]]
DTYPES = [torch.float16, torch.int32, torch.complex64, torch.bool, torch.bfloat16]


def _inputs(ranks: list[int], seed: int) -> dict[int, torch.Tensor]:
    """A different dtype and shape per rank (one of them 0-dim)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (7,), (), (2, 2, 2), (4, 300)]
    return {r: make_input(DTYPES[r % 5], shapes[r % 5], gen) for r in ranks}


def _same_bits(a: torch.Tensor | None, b: torch.Tensor, what: str) -> None:
    assert a is not None, f"{what}: nothing stored"
    assert (a.dtype, a.shape) == (b.dtype, b.shape), (
        f"{what}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
    )
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def _exchange(cl: Cluster, pairs: Pairs, out: str = "", group_id: int = 0) -> list:
    args = worker_pb2.ExchangeArgs(
        name="x", out=out, srcs=[s for s, _ in pairs], dsts=[d for _, d in pairs]
    )
    return cl.run(worker_pb2.OpDescriptor(kind=OpKind.EXCHANGE, group_id=group_id, exchange=args))


def _check(cl: Cluster, pairs: Pairs, xs: dict[int, torch.Tensor], out: str, data: FakeWorld):
    before = {r: x.clone() for r, x in xs.items()}
    cl.put("x", xs)
    data_before = [c.copy() for c in data.calls]
    results = _exchange(cl, pairs, out, group_id=max(cl.ctxs[0].groups))
    members = cl.ctxs[0].groups[max(cl.ctxs[0].groups)].ranks
    data_calls = [c - b for c, b in zip(data.calls, data_before, strict=True)]
    target, src_of = out or "x", {d: s for s, d in pairs}
    for r, res in enumerate(results):
        assert isinstance(res, OpResult), f"rank {r}: {res!r}"
        assert (res.result_name, res.result_ranks) == (target, sorted(src_of))
        if r in src_of:
            _same_bits(cl.ctxs[r].store.peek(target), before[src_of[r]], f"rank {r}")
        elif out:
            assert cl.ctxs[r].store.peek(out) is None, f"rank {r} stored {out!r}"
        if r in xs and (out or r not in src_of):
            _same_bits(cl.ctxs[r].store.peek("x"), before[r], f"rank {r}'s own x")
        moved = Counter(send=sum(s == r for s, _ in pairs), recv=int(r in src_of))
        if data is cl.world:
            assert cl.calls[r] == Counter({EXCHANGE: 2}) + moved, f"rank {r}: {cl.calls[r]}"
        else:
            assert cl.calls[r] == Counter({EXCHANGE: 2}), f"rank {r}: {cl.calls[r]}"
            if r in members:
                assert data_calls[members.index(r)] == moved, f"rank {r}: {data_calls}"


# ------------------------------------------------------------ exchange
@pytest.mark.parametrize("out", ["", "y"])
def test_ring_shift_over_three_ranks_leaves_rank_j_what_rank_j_minus_1_held(
    out: str, seed: int
) -> None:
    cl = Cluster(3)
    _check(cl, [(0, 1), (1, 2), (2, 0)], _inputs([0, 1, 2], seed), out, cl.world)


@pytest.mark.parametrize("size", [2, 3])
def test_send_one_pair_and_the_rank_named_in_no_pair_is_untouched(size: int, seed: int) -> None:
    cl = Cluster(size)
    xs = _inputs(list(range(size)), seed)
    _check(cl, [(size - 1, 0)], xs, "", cl.world)  # the leader receives
    _check(cl, [(0, size - 1)], _inputs(list(range(size)), seed + 1), "y", cl.world)


def test_one_src_to_several_dsts_and_a_swap() -> None:
    cl = Cluster(3)
    xs = _inputs([0, 1, 2], 7)
    _check(cl, [(1, 0), (1, 2)], xs, "y", cl.world)
    _check(cl, [(0, 2), (2, 0)], _inputs([0, 1, 2], 8), "", cl.world)


def test_sub_group_pairs_are_global_ranks_and_move_on_the_groups_data_world(seed: int) -> None:
    cl = Cluster(3)
    sub = FakeWorld(2, TIMEOUT_S)
    cl.add_group(1, [1, 2], sub)
    xs = _inputs([0, 1, 2], seed)
    _check(cl, [(2, 1), (1, 2)], xs, "", sub)


def test_an_empty_tensor_moves_no_bytes_but_is_stored(seed: int) -> None:
    cl = Cluster(2)
    cl.put("x", {0: torch.empty((0, 3), dtype=torch.float64)})
    results = _exchange(cl, [(0, 1)], "y")
    assert all(isinstance(r, OpResult) for r in results), results
    assert cl.ctxs[1].store.peek("y").shape == (0, 3)
    assert all("send" not in c and "recv" not in c for c in cl.calls), cl.calls


VALIDATION = {
    "absent_on_every_src": ([(0, 1), (2, 0)], {0, 2}, None, grpc.StatusCode.NOT_FOUND,
                            "not found on any src rank (0, 2)"),
    "absent_on_one_src": ([(0, 1), (2, 0)], {2}, None, grpc.StatusCode.FAILED_PRECONDITION,
                          "missing on src rank(s) 2 but present on src rank(s) 0"),
    "dst_over_quota": ([(0, 2), (1, 0)], set(), {2: 200}, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       "failed on rank(s) 2: storing 'y'"),
}  # fmt: skip


@pytest.mark.parametrize("case", VALIDATION)
def test_validation_fails_alike_everywhere_and_commits_nothing(case: str, seed: int) -> None:
    pairs, absent, limits, code, words = VALIDATION[case]
    cl = Cluster(3, limits=limits)
    gen = torch.Generator().manual_seed(seed)
    xs = {r: torch.randn(4, 8, generator=gen) for r in range(3) if r not in absent}
    cl.put("x", xs)
    results = _exchange(cl, pairs, "y")
    first = results[0]
    assert isinstance(first, CollectiveError), results
    assert first.code == code and words in first.message, first
    for res in results[1:]:
        assert type(res) is type(first) and (res.code, res.message) == (first.code, first.message)
    assert cl.stored("y") == [None] * 3
    assert all(cl.ctxs[r].store.peek("x") is xs.get(r) for r in range(3))
    assert all(c == Counter({EXCHANGE: 1}) for c in cl.calls), cl.calls  # decided, nothing moved


def test_a_transport_failure_breaks_the_group_on_every_rank_and_commits_nothing(
    seed: int,
) -> None:
    """Rank 1's send fails (its recv went through): rank 2, waiting on rank 1's bytes,
    sees the connection cut; rank 0, done with its part, waits in the agreement for
    peers that never come. No rank reports success or commits."""
    cl = Cluster(3, data=FakeWorld(3, 1.0), timeout_s=1.0)
    cl.put("x", _inputs([0, 1, 2], seed))
    cl.data.fail_next(1, RuntimeError("Connection closed by peer"))
    results = _exchange(cl, [(0, 1), (1, 2), (2, 0)], "y")
    assert all(isinstance(r, GroupBroken) for r in results), results
    assert "closed by peer" in str(results[1]).lower()
    assert cl.stored("y") == [None] * 3


def test_a_rank_lost_in_the_middle_fails_every_rank_with_nothing_committed(seed: int) -> None:
    """Rank 2 dies once its peers posted: every pending send/recv fails at once."""
    cl = Cluster(3, data=FakeWorld(3, 2.0), timeout_s=2.0)
    xs = _inputs([0, 1, 2], seed)
    cl.put("x", xs)
    cl.ctxs[2].replaced = DyingReplacedMemory(cl.data, 2)
    results = _exchange(cl, [(0, 1), (1, 2), (2, 0)])
    assert all(isinstance(r, GroupBroken) for r in results), results
    assert all(cl.ctxs[r].store.peek("x") is xs[r] for r in range(3))


class DyingReplacedMemory(ReplacedMemory):
    """Kills ``rank`` in ``world`` when it allocates its receive buffer."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        super().__init__()
        self.world, self.rank = world, rank

    def empty(self, shape, dtype, device) -> torch.Tensor:
        self.world.kill(self.rank)
        return super().empty(shape, dtype, device)


# ------------------------------------------------------------ destroy_group
def _destroy(cl: Cluster, group_id: int) -> list:
    args = worker_pb2.DestroyGroupArgs(group_id=group_id)
    return cl.run(worker_pb2.OpDescriptor(kind=OpKind.DESTROY_GROUP, destroy_group=args))


def test_destroy_group_drops_it_on_every_rank_then_its_ops_and_a_second_destroy_are_not_found():
    cl = Cluster(3)
    cl.add_group(4, [0, 2], FakeWorld(2, TIMEOUT_S))
    results = _destroy(cl, 4)
    assert all(isinstance(r, OpResult) and r.result_ranks == [0, 2] for r in results), results
    assert all(4 not in ctx.groups for ctx in cl.ctxs)
    desc = worker_pb2.OpDescriptor(kind=OpKind.EXCHANGE, group_id=4)
    missing = run_ranks(cl.world, lambda r, _: missing_group(cl.ctxs[r], desc, Announcement()))
    again = _destroy(cl, 4)
    for res in (*missing, *again):
        assert isinstance(res, CollectiveError) and res.code == grpc.StatusCode.NOT_FOUND, res
        assert "group 4 does not exist in generation 1" in res.message
    refused = _destroy(cl, 0)
    assert all(r.code == grpc.StatusCode.INVALID_ARGUMENT for r in refused), refused
    assert all(0 in ctx.groups for ctx in cl.ctxs)
    assert all(c == Counter() for c in cl.calls), cl.calls  # no round: decided alike everywhere


# ------------------------------------------------------------ the fake's point to point
def test_fake_send_recv_match_by_pair_and_tag_and_check_sizes() -> None:
    world = FakeWorld(2, 2.0)

    def body(rank: int, pg) -> list[torch.Tensor]:
        a, b = torch.full((3,), rank + 1.0), torch.zeros(3)
        c = torch.zeros(2)
        works = [pg.send([a], 1 - rank, 5), pg.recv([b], 1 - rank, 5)]
        works.append(pg.send([a], 1 - rank, 6) if rank == 0 else pg.recv([c], 0, 6))
        errors = []
        for w in works:
            try:
                w.wait()
            except RuntimeError as exc:
                errors.append(str(exc))
        return [b, errors]

    (b0, e0), (b1, e1) = run_ranks(world, body)
    assert torch.equal(b0, torch.full((3,), 2.0)) and torch.equal(b1, torch.ones(3))
    assert len(e0) == len(e1) == 1 and "size mismatch" in e0[0]


# ------------------------------------------------------------ check_pairs
def test_check_pairs_accepts_valid_pairs_in_their_order() -> None:
    assert check_pairs([(0, 1), [1, 2], (2, 0)], 3) == [(0, 1), (1, 2), (2, 0)]
    assert check_pairs([(3, 1)], 4, [1, 3]) == [(3, 1)]
    assert check_pairs(((1, 0), (1, 2)), 3, None) == [(1, 0), (1, 2)]


@pytest.mark.parametrize(
    ("pairs", "members", "words"),
    [
        ([], None, "pairs is empty"),
        ("01", None, "list of (src, dst) pairs"),
        ([(0, 1, 2)], None, "pair 0 must be a (src, dst) pair"),
        ([(1, 1)], None, "pair 0 sends rank 1 to itself"),
        ([(0, 3)], None, "dst 3 is out of range; valid ranks are 0..2"),
        ([(-1, 0)], None, "src -1 is out of range"),
        ([(0, True)], None, "dst must be an int"),
        ([(0, 2), (1, 2)], None, "dst rank(s) [2] named in more than one pair"),
        ([(0, 1)], [1, 2], "src 0 (pair 0) is not a member of the group (global ranks [1, 2])"),
        ([(1, 2), (2, 0)], [1, 2], "dst 0 (pair 1) is not a member"),
    ],
)
def test_check_pairs_refuses_with_invalid_argument(pairs, members, words: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_pairs(pairs, 3, members)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.message, info.value.message
