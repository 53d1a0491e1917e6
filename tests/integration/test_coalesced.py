"""Coalesced collectives (a list of names is one atomic op) on real local clusters
of 2 and 3 workers: ``all_reduce``, ``broadcast`` and ``all_gather`` of names of
mixed dtypes and shapes, in sub-groups and with ``async_op``, against torch
computed locally on the same fresh random inputs; every error case with its
code, and no tensor changed on any rank when one name fails; the data moves in
one collective per (dtype, bucket), read from the leader's counter.
"""

from __future__ import annotations

import re

import grpc
import pytest
import torch
from collective_cases import TIMEOUT_S
from helpers import assert_tensor, get_each, make_input, reduce_oracle
from raw_grpc import assert_healthy, opts

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire.op_args import MAX_COALESCED

# tag -> (dtype, shape): every dtype family of the issue, in differing shapes
MIXED = {
    "f32": (torch.float32, (4, 3)),
    "f64": (torch.float64, (5,)),
    "i64": (torch.int64, (2, 3, 2)),
    "b": (torch.bool, (7,)),
    "bf16": (torch.bfloat16, (3, 3)),
    "c64": (torch.complex64, (6,)),
}


def _put_mixed(cluster, uname, gen, ranks=None, specs=MIXED) -> tuple[list[str], dict]:
    """Fresh random tensors for every tag on each of ``ranks`` (default: all);
    returns the names and {name: [tensor per rank, None where not put]}."""
    ranks = range(cluster.world_size) if ranks is None else ranks
    names, inputs = [], {}
    for tag, (dtype, shape) in specs.items():
        name = uname(tag)
        names.append(name)
        inputs[name] = [None] * cluster.world_size
        for r in ranks:
            inputs[name][r] = make_input(dtype, shape, gen)
            cluster.put(name, inputs[name][r], rank=r)
    return names, inputs


def _exact(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _assert_unchanged(cluster, inputs: dict) -> None:
    """Every name on every rank is exactly what was put (absent where none was)."""
    for name, by_rank in inputs.items():
        for r, want in enumerate(by_rank):
            if want is None:
                with pytest.raises(collectives.NotFound):
                    cluster.get(name, rank=r)
            else:
                assert_tensor(cluster.get(name, rank=r), want, what=f"rank {r} {name!r}")


# ------------------------------------------------------------------ results
@pytest.mark.parametrize("op", ["sum", "product"])
def test_all_reduce_of_mixed_dtypes_and_shapes(cluster, gen, uname, op):
    names, inputs = _put_mixed(cluster, uname, gen)

    assert cluster.all_reduce(names, op=op, timeout=TIMEOUT_S) is None

    for name in names:
        expected = reduce_oracle(op, inputs[name])
        results = get_each(cluster, name)
        for rank, got in enumerate(results):
            assert_tensor(got, expected, exact=_exact(expected.dtype), what=f"rank {rank} {name}")
            assert torch.equal(got, results[0]), f"rank {rank} differs from rank 0 ({name})"


def test_broadcast_of_mixed_dtypes_from_the_last_rank(cluster, gen, uname):
    src = cluster.world_size - 1
    names, inputs = _put_mixed(cluster, uname, gen, ranks=[src])
    cluster.put(names[0], torch.zeros(2, dtype=torch.int8), rank=0)  # replaced, any dtype

    assert cluster.broadcast(names, src=src, timeout=TIMEOUT_S) is None

    for name in names:
        for rank, got in enumerate(get_each(cluster, name)):
            assert_tensor(got, inputs[name][src], what=f"rank {rank} {name}")


@pytest.mark.parametrize("use_out", [False, True], ids=["in-place", "out"])
def test_all_gather_returns_one_list_of_parts_per_name(cluster, gen, uname, use_out):
    names, inputs = _put_mixed(cluster, uname, gen)
    outs = [uname("out") for _ in names] if use_out else None

    parts = cluster.all_gather(names, out=outs, timeout=TIMEOUT_S)

    assert isinstance(parts, list) and len(parts) == len(names)
    for name, target, got in zip(names, outs or names, parts, strict=True):
        assert len(got) == cluster.world_size, name
        for rank, part in enumerate(got):
            assert_tensor(part, inputs[name][rank], what=f"part {rank} of {name}")
        for rank, stored in enumerate(get_each(cluster, target)):
            assert_tensor(stored, torch.stack(inputs[name]), what=f"rank {rank} {target}")
        if use_out:
            for rank, kept in enumerate(get_each(cluster, name)):
                assert_tensor(kept, inputs[name][rank], what=f"rank {rank} keeps {name}")


def test_in_a_sub_group(cluster3, gen, uname):
    cluster, members = cluster3, [0, 2]
    group = cluster.new_group(members)
    specs = {k: MIXED[k] for k in ("f32", "i64", "b")}
    names, inputs = _put_mixed(cluster, uname, gen, specs=specs)

    cluster.all_reduce(names, op="max", group=group, timeout=TIMEOUT_S)
    parts = cluster.all_gather(names, group=group, timeout=TIMEOUT_S)

    for name, got in zip(names, parts, strict=True):
        reduced = reduce_oracle("max", [inputs[name][r] for r in members])
        assert [p.shape for p in got] == [reduced.shape] * 2, name
        for part in got:
            assert_tensor(part, reduced, what=f"{name} gathered")
        assert_tensor(cluster.get(name, rank=1), inputs[name][1], what=f"non-member {name}")
    src = uname("src")
    cluster.put(src, torch.arange(5), rank=2)
    cluster.broadcast([src], src=2, group=group, timeout=TIMEOUT_S)
    assert_tensor(cluster.get(src, rank=0), torch.arange(5), what="broadcast in the group")
    with pytest.raises(collectives.NotFound):
        cluster.get(src, rank=1)


def test_async_op_handles_return_what_the_sync_calls_return(cluster2, gen, uname):
    cluster = cluster2
    names, inputs = _put_mixed(cluster, uname, gen, specs={"a": MIXED["f64"], "b": MIXED["i64"]})
    reduced = cluster.all_reduce(names, async_op=True, timeout=TIMEOUT_S)
    gathered = cluster.all_gather(names, async_op=True, timeout=TIMEOUT_S)
    cast = cluster.broadcast(names, src=1, async_op=True, timeout=TIMEOUT_S)

    assert isinstance(reduced, collectives.Work) and reduced.result(TIMEOUT_S) is None
    parts = gathered.result(TIMEOUT_S)
    assert cast.result(TIMEOUT_S) is None
    for name, got in zip(names, parts, strict=True):
        summed = reduce_oracle("sum", inputs[name])
        assert len(got) == 2, name
        for part in got:  # gathered after the all_reduce: in call order
            assert_tensor(part, summed, exact=_exact(summed.dtype), what=name)
        stacked = torch.stack(got)
        for rank in (0, 1):  # broadcast after the all_gather: the stack, from rank 1
            assert_tensor(cluster.get(name, rank=rank), stacked, what=f"rank {rank} {name}")


# ------------------------------------------------------------ data collectives
def _data_collectives(cluster) -> int:
    """The leader's counter (it has run its part of an op before the op returns)."""
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(cluster.leader))
    return stub.GetState(worker_pb2.GetStateRequest(), timeout=10).status.data_collectives


def test_200_small_tensors_take_one_data_collective_per_dtype(cluster, gen, uname):
    specs = {f"t{i}": (torch.float32 if i % 2 else torch.int64, (512 + i % 3,)) for i in range(200)}
    names, inputs = _put_mixed(cluster, uname, gen, specs=specs)  # ~4 KiB each, < 25 MiB
    before = _data_collectives(cluster)

    cluster.all_reduce(names, op="sum", timeout=TIMEOUT_S)

    assert _data_collectives(cluster) - before == 2  # one per (dtype, bucket)
    for name in names[::37]:
        expected = reduce_oracle("sum", inputs[name])
        for rank, got in enumerate(get_each(cluster, name)):
            assert_tensor(got, expected, exact=_exact(expected.dtype), what=f"rank {rank}")


# ------------------------------------------------------------------ errors
BAD_NAMES = {
    "duplicate": lambda n: [n[0], n[1], n[0]],
    "none": lambda n: [],
    "too_many": lambda n: [f"{n[0]}/{i}" for i in range(MAX_COALESCED + 1)],
}


@pytest.mark.parametrize("case", BAD_NAMES)
def test_bad_name_lists_are_invalid_argument_at_the_call(cluster2, uname, case):
    names = BAD_NAMES[case]([uname(), uname()])
    for call in (
        lambda: cluster2.all_reduce(names),
        lambda: cluster2.broadcast(names, async_op=True),
        lambda: cluster2.all_gather(names),
    ):
        with pytest.raises(collectives.InvalidArgument) as err:
            call()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_out_names_must_match_the_names(cluster2, uname):
    names = [uname(), uname()]
    for out, words in (([uname()], "one per name"), ([uname()] * 2, "distinct"), (uname(), "list")):
        with pytest.raises(collectives.InvalidArgument, match=words) as err:
            cluster2.all_gather(names, out=out)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # all_reduce of a list takes a list of out names, checked alike.
    for out, words in (([uname()], "one per name"), ([uname()] * 2, "distinct"), (uname(), "list")):
        with pytest.raises(collectives.InvalidArgument, match=words):
            cluster2.all_reduce(names, out=out)


RAW = {  # the servicer checks the same (other clients exist)
    "duplicate": lambda n: worker_pb2.AllReduceRequest(options=opts(), names=[n, n]),
    "too_many": lambda n: worker_pb2.BroadcastRequest(
        options=opts(), names=[f"{n}/{i}" for i in range(MAX_COALESCED + 1)]
    ),
    "outs_length": lambda n: worker_pb2.AllGatherRequest(
        options=opts(), names=[n, f"{n}/2"], outs=[f"{n}/o"]
    ),
    "name_and_names": lambda n: worker_pb2.AllReduceRequest(options=opts(), name=n, names=[n]),
}
_METHOD = {
    worker_pb2.AllReduceRequest: "AllReduce",
    worker_pb2.BroadcastRequest: "Broadcast",
    worker_pb2.AllGatherRequest: "AllGather",
}


@pytest.mark.parametrize("case", RAW)
def test_the_servicer_refuses_bad_name_lists(env, case):
    request = RAW[case](env.name())
    with pytest.raises(grpc.RpcError) as err:
        getattr(env.leader, _METHOD[type(request)])(request, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert_healthy(env)


FAILURES = {
    # case: (what to do to the second name on rank 1, op, error, words)
    "missing_on_one_rank": ("delete", "sum", collectives.FailedPrecondition,
                            "is missing on rank(s) 1"),
    "dtype_mismatch": ("dtype", "sum", collectives.FailedPrecondition, "disagrees across ranks"),
    "shape_mismatch": ("shape", "sum", collectives.FailedPrecondition, "disagrees across ranks"),
    "bitwise_on_float": (None, "band", collectives.InvalidArgument, "all_reduce of"),
}  # fmt: skip


FAILURE_CASES = [
    (case, kind)
    for case in FAILURES
    for kind in ("all_reduce", "all_gather")
    if kind == "all_reduce" or FAILURES[case][1] == "sum"  # all_gather does not reduce
]


@pytest.mark.parametrize(("case", "kind"), FAILURE_CASES)
def test_one_failing_name_fails_the_op_and_changes_no_tensor_anywhere(
    cluster, gen, uname, case, kind
):
    tamper, op, error, words = FAILURES[case]
    specs = {"i": (torch.int64, (4,)), "f": (torch.float32, (3, 2)), "b": (torch.bool, (5,))}
    names, inputs = _put_mixed(cluster, uname, gen, specs=specs)
    bad = names[1]
    if tamper == "delete":
        cluster.delete(bad, rank=1)
        inputs[bad][1] = None
    elif tamper is not None:
        other = torch.zeros(3, 2, dtype=torch.float64) if tamper == "dtype" else torch.zeros(7)
        cluster.put(bad, other, rank=1)
        inputs[bad][1] = other
    outs = [uname("out") for _ in names]
    for o in outs:
        inputs[o] = [None] * cluster.world_size

    with pytest.raises(error, match=re.escape(words)) as err:
        if kind == "all_reduce":
            cluster.all_reduce(names, op=op, timeout=TIMEOUT_S)
        else:
            cluster.all_gather(names, out=outs, timeout=TIMEOUT_S)

    assert repr(bad) in err.value.message, err.value.message
    _assert_unchanged(cluster, inputs)


def test_a_name_absent_everywhere_is_not_found_and_changes_nothing(cluster, gen, uname):
    names, inputs = _put_mixed(cluster, uname, gen, specs={"a": MIXED["f32"], "b": MIXED["b"]})
    ghost = uname("ghost")
    for call in (
        lambda: cluster.all_reduce([*names, ghost], timeout=TIMEOUT_S),
        lambda: cluster.broadcast([ghost, *names], src=1, timeout=TIMEOUT_S),
        lambda: cluster.all_gather([names[0], ghost], timeout=TIMEOUT_S),
    ):
        with pytest.raises(collectives.NotFound, match="not found on any rank") as err:
            call()
        assert err.value.code == grpc.StatusCode.NOT_FOUND and repr(ghost) in err.value.message
        _assert_unchanged(cluster, {**inputs, ghost: [None] * cluster.world_size})


def test_broadcast_with_a_name_missing_on_src_changes_nothing(cluster, gen, uname):
    names, inputs = _put_mixed(cluster, uname, gen, specs={"a": MIXED["f32"], "b": MIXED["i64"]})
    cluster.delete(names[1], rank=0)
    inputs[names[1]][0] = None
    with pytest.raises(collectives.FailedPrecondition, match="missing on src rank 0"):
        cluster.broadcast(names, src=0, timeout=TIMEOUT_S)
    _assert_unchanged(cluster, inputs)
