"""The GPU data path under NCCL's semantics, without a GPU (tests/fake_nccl.py).

NCCL's ``wait()`` returns before the data exists; a peer dying inside a kernel
leaves it spinning; a CPU tensor, a bitwise reduction or an int16 is refused;
a mix of CPU and CUDA members would wait forever in two different rendezvous.
Each test runs the worker's own code (handlers, ``build_groups``, generation
teardown) over the fake and checks what a rank commits and how it fails.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from fake_nccl import NOCOLOR, FakeNcclWorld, split_factory
from fake_pg import run_ranks
from handler_world import Cluster, check_collective, inputs, reference

from collectives.reduce_ops import ReduceOp
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine.device_completion import CompletingGroup, DeviceTimeout
from collectives_server.worker.engine.handlers.exchange_ops import DEVICE_P2P_MIN_BYTES
from collectives_server.worker.engine.op_context import OpResult
from collectives_server.worker.engine.process_groups import (
    NCCL_ERROR_HANDLING_ENV,
    GroupHandles,
    MixedDevices,
    build_groups,
    configure_nccl_error_handling,
    release_groups,
)

CPU = torch.device("cpu")
META = torch.device("meta")


# ---------------------------------------------------------------- the fake itself
def test_the_fakes_wait_returns_before_the_data_exists() -> None:
    """As on NCCL: a caller that trusts wait() reads its own input back, not the sum."""
    world = FakeNcclWorld(2, CPU, completing=False)
    xs = [torch.randn(8, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def body(rank: int, pg) -> tuple[torch.Tensor, torch.Tensor]:
        buf = xs[rank].clone()
        work = pg.allreduce([buf])
        work.wait()
        early = buf.clone()
        deadline = time.monotonic() + 5
        while not work.is_completed():
            assert time.monotonic() < deadline, "never completed"
        return early, buf

    results = run_ranks(world, body, 10)
    for rank, (early, late) in enumerate(results):
        assert torch.equal(early, xs[rank])
        torch.testing.assert_close(late, xs[0] + xs[1])


def test_the_fake_refuses_what_nccl_refuses() -> None:
    world = FakeNcclWorld(1, META, completing=False)
    pg = world.raw(0)
    with pytest.raises(RuntimeError, match="Tensors must be on meta"):
        pg.allreduce([torch.ones(2)])
    with pytest.raises(RuntimeError, match="Unsupported data type"):
        pg.allreduce([torch.ones(2, dtype=torch.int16, device=META)])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.BAND
    with pytest.raises(RuntimeError, match="BAND"):
        pg.allreduce([torch.ones(2, dtype=torch.int32, device=META)], opts)


# ------------------------------------------------------------- completion on device
@pytest.mark.parametrize(
    "kind",
    [
        OpKind.ALL_REDUCE,
        OpKind.BROADCAST,
        OpKind.ALL_GATHER,
        OpKind.REDUCE_SCATTER,
        OpKind.ALL_TO_ALL,
        OpKind.REDUCE,
        OpKind.GATHER,
    ],
)
def test_every_collective_commits_what_completed_on_the_device(kind: OpKind) -> None:
    """Through the worker's CompletingGroup, each handler commits the torch result
    although the fake's wait() returns before the data exists."""
    data = FakeNcclWorld(3, CPU)
    cl = Cluster(3, data=data)  # type: ignore[arg-type]
    xs = inputs([0, 1, 2], torch.float32, (6, 1 << 14), seed=hash(kind) & 0xFFFF)
    check_collective(cl, kind, xs, large=True, data=data)  # type: ignore[arg-type]


def test_without_completion_a_rank_would_commit_garbage() -> None:
    """The same all_reduce with the raw NCCL-like group commits what was in the
    buffer, not the sum: the hazard the CompletingGroup exists for."""
    data = FakeNcclWorld(2, CPU, completing=False)
    cl = Cluster(2, data=data)  # type: ignore[arg-type]
    xs = inputs([0, 1], torch.float32, (6, 1 << 14), seed=5)
    cl.put("x", xs)
    results = cl.tensor_op(OpKind.ALL_REDUCE, name="x", out="y", op=0)
    assert all(isinstance(r, OpResult) for r in results), results
    want = xs[0] + xs[1]
    assert not all(torch.allclose(cl.ctxs[r].store.peek("y"), want) for r in range(2))


def test_a_peer_hung_inside_a_kernel_fails_the_op_within_its_timeout() -> None:
    data = FakeNcclWorld(2, CPU, timeout_s=0.5)
    data.hang(1)
    cl = Cluster(2, data=data, timeout_s=2.0)  # type: ignore[arg-type]
    xs = inputs([0, 1], torch.float32, (6, 1 << 14), seed=7)
    cl.put("x", xs)
    started = time.monotonic()
    results = cl.tensor_op(OpKind.ALL_REDUCE, name="x", out="y", op=0)
    took = time.monotonic() - started
    assert not any(isinstance(r, OpResult) for r in results), results
    assert "timed out on the device" in str(results[1]), results[1]
    assert took < 10, took
    assert all(cl.ctxs[r].store.peek("y") is None for r in range(2))


def test_completing_work_raises_on_timeout_and_on_failure() -> None:
    class Never:
        def wait(self, timeout=None) -> bool:
            return True

        def is_completed(self) -> bool:
            return False

    group = CompletingGroup(SimpleNamespace(allreduce=lambda *a: Never()), timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(DeviceTimeout, match="allreduce timed out on the device"):
        group.allreduce([torch.ones(1)]).wait()
    assert time.monotonic() - started < 2

    class Failed(Never):
        calls = 0

        def wait(self, timeout=None) -> bool:
            Failed.calls += 1
            if Failed.calls > 1:
                raise RuntimeError("NCCL error: unhandled system error")
            return True

        def is_completed(self) -> bool:
            return True

    group = CompletingGroup(SimpleNamespace(broadcast=lambda *a: Failed()), timeout_s=5)
    with pytest.raises(RuntimeError, match="unhandled system error"):
        group.broadcast([torch.ones(4)]).wait()


# ------------------------------------------------------------------- formation
def _build_on_threads(devices: list[torch.device], world: FakeNcclWorld | None):
    """build_groups on one thread per rank over one in-memory store; each rank's
    handles or exception."""
    store = dist.HashStore()
    size = len(devices)
    made: list[int] = []

    def nccl(st, rank, n, timeout_s, device, split=None):
        made.append(rank)
        assert world is not None, "no NCCL group may be made for this membership"
        return world.raw(rank)

    def build(rank: int, _pg: object) -> object:
        return build_groups(store, "g1", rank, size, 10.0, devices[rank], nccl=nccl)

    ranks = SimpleNamespace(size=size, pg=lambda rank: None)
    return run_ranks(ranks, build), made


def test_an_accelerator_group_is_wrapped_and_connected_at_formation() -> None:
    world = FakeNcclWorld(2, META, completing=False)
    results, made = _build_on_threads([META, META], world)
    for rank, handles in enumerate(results):
        assert isinstance(handles, GroupHandles), handles
        assert isinstance(handles.data, CompletingGroup)
        assert handles.data.wrapped is world.raw(rank)
        assert handles.control is not handles.data
        assert world.calls[rank]["allreduce"] == 1  # the eager connection
    assert sorted(made) == [0, 1]


def test_cpu_members_share_the_gloo_group() -> None:
    results, made = _build_on_threads([CPU, CPU], None)
    for handles in results:
        assert isinstance(handles, GroupHandles), handles
        assert handles.data is handles.control
    assert made == []


def test_a_membership_mixing_cpu_and_gpu_is_refused_on_every_member() -> None:
    results, made = _build_on_threads([CPU, META], FakeNcclWorld(2, META, completing=False))
    for exc in results:
        assert isinstance(exc, MixedDevices), exc
        assert "rank 0: cpu" in str(exc) and "--devices" in str(exc)
    assert made == []


def test_two_members_on_one_gpu_are_refused_before_nccl_starts() -> None:
    cuda0 = torch.device("cuda", 0)
    results, made = _build_on_threads([cuda0, cuda0], None)
    for exc in results:
        assert isinstance(exc, MixedDevices), exc
        assert "both use cuda:0" in str(exc)
    assert made == []


def test_released_groups_abort_their_communicators() -> None:
    world = FakeNcclWorld(2, META, completing=False)
    groups = {
        0: SimpleNamespace(
            handles=GroupHandles(control=None, data=CompletingGroup(world.raw(0), 1))
        ),  # type: ignore[arg-type]
        1: SimpleNamespace(handles=None),
    }
    release_groups(groups)
    release_groups(groups)  # idempotent
    assert world.states[0].aborts == 1
    with pytest.raises(RuntimeError, match="aborted"):
        world.raw(0).allreduce([torch.ones(1, device=META)])


@pytest.mark.parametrize("had", [None, "3", "1", "2"])
def test_nccl_errors_abort_the_communicator_and_keep_the_worker(had, caplog) -> None:
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): a dead peer aborts the
    communicator and fails its works; torch's default would end the process."""
    environ = {} if had is None else {NCCL_ERROR_HANDLING_ENV: had}
    configure_nccl_error_handling(environ)
    assert environ[NCCL_ERROR_HANDLING_ENV] == "2"
    warned = any(NCCL_ERROR_HANDLING_ENV in r.getMessage() for r in caplog.records)
    assert warned == (had not in (None, "2"))


@pytest.mark.parametrize(
    ("op", "dtype"),
    [
        (ReduceOp.BAND, torch.int32),
        (ReduceOp.BOR, torch.int64),
        (ReduceOp.BXOR, torch.uint8),
        (ReduceOp.SUM, torch.int16),
        (ReduceOp.MAX, torch.int16),
        (ReduceOp.PRODUCT, torch.int16),
    ],
)
@pytest.mark.parametrize("large", [False, True])
def test_what_nccl_lacks_is_reduced_through_a_path_it_has(op, dtype, large) -> None:
    """Bitwise reductions and int16 give torch's result on an NCCL data group (which
    refuses them): gathered as bytes and folded in rank order on every member."""
    data = FakeNcclWorld(3, CPU)
    cl = Cluster(3, data=data)  # type: ignore[arg-type]
    shape = (6, (1 << 15) if large else 3)
    xs = inputs([0, 1, 2], dtype, shape, seed=int(op.wire) * 31 + len(str(dtype)))
    cl.put("x", xs)
    results = cl.tensor_op(OpKind.ALL_REDUCE, name="x", out="y", op=op.wire)
    assert all(isinstance(r, OpResult) for r in results), results
    want = reference(op, [xs[r] for r in range(3)])
    for r in range(3):
        assert torch.equal(cl.ctxs[r].store.peek("y"), want), f"rank {r}"


# --------------------------------------------------------------- point to point
def _shift(rank: int, pg, n: int, coalesce: bool, x: torch.Tensor) -> torch.Tensor:
    """A ring shift: send to the right, receive from the left (as exchange does)."""
    into = torch.empty_like(x)
    if coalesce:
        pg._start_coalescing(CPU)
    sent = pg.send([x], (rank + 1) % n, 0)
    got = pg.recv([into], (rank - 1) % n, 0)
    if coalesce:
        pg._end_coalescing(CPU).wait()
    else:
        sent.wait()
        got.wait()
    return into


def test_the_fakes_uncoalesced_ring_shift_hangs_and_a_group_call_completes() -> None:
    """NCCL's stream: blocking sends issued before their receives wait forever for
    the peers' receives, queued behind the peers' own sends."""
    xs = inputs([0, 1, 2], torch.float32, (64,), seed=11)
    hung = FakeNcclWorld(3, CPU, timeout_s=0.3)
    results = run_ranks(hung, lambda r, pg: _shift(r, pg, 3, False, xs[r]))
    assert all(isinstance(r, DeviceTimeout) for r in results), results
    done = FakeNcclWorld(3, CPU)
    results = run_ranks(done, lambda r, pg: _shift(r, pg, 3, True, xs[r]))
    for r in range(3):
        assert torch.equal(results[r], xs[(r - 1) % 3]), r


def _exchange_on(data: FakeNcclWorld, pairs, xs):
    cl = Cluster(data.size, data=data)  # type: ignore[arg-type]
    cl.put("x", xs)
    before = [c.copy() for c in data.calls]
    args = worker_pb2.ExchangeArgs(
        name="x", out="y", srcs=[s for s, _ in pairs], dsts=[d for _, d in pairs]
    )
    results = cl.run(worker_pb2.OpDescriptor(kind=OpKind.EXCHANGE, exchange=args))
    moved = [c - b for c, b in zip(data.calls, before, strict=True)]
    return cl, results, moved


@pytest.mark.parametrize(
    "pairs", [[(0, 1), (1, 2), (2, 0)], [(2, 0)], [(0, 1), (0, 2), (1, 0)]], ids=str
)
def test_a_large_exchange_moves_on_the_device_in_one_group_call(pairs) -> None:
    """Above DEVICE_P2P_MIN_BYTES every rank's sends and receive go to the NCCL group
    in one coalesced launch: a ring shift completes (blocking sends would hang) and
    each dst holds its src's tensor bit for bit; nothing crosses the control group."""
    rows = DEVICE_P2P_MIN_BYTES // 4 // 8 + 1  # just above the bound in float32
    xs = inputs([0, 1, 2], torch.float32, (rows, 8), seed=len(pairs))
    xs[1] = xs[1].to(torch.float64)  # sources may differ in dtype
    cl, results, moved = _exchange_on(FakeNcclWorld(3, CPU, timeout_s=2.0), pairs, xs)
    assert all(isinstance(r, OpResult) for r in results), results
    for s, d in pairs:
        assert torch.equal(cl.ctxs[d].store.peek("y"), xs[s]), (s, d)
    for r in range(3):
        sends, recvs = sum(s == r for s, _ in pairs), sum(d == r for _, d in pairs)
        assert (moved[r]["send"], moved[r]["recv"]) == (sends, recvs), (r, moved[r])
        assert cl.calls[r]["send"] == cl.calls[r]["recv"] == 0, cl.calls[r]


def test_a_small_exchange_crosses_the_host_on_the_control_group() -> None:
    xs = inputs([0, 1, 2], torch.float32, (4, 8), seed=3)
    pairs = [(0, 1), (1, 2), (2, 0)]
    cl, results, moved = _exchange_on(FakeNcclWorld(3, CPU, timeout_s=2.0), pairs, xs)
    assert all(isinstance(r, OpResult) for r in results), results
    for s, d in pairs:
        assert torch.equal(cl.ctxs[d].store.peek("y"), xs[s]), (s, d)
    assert all(m["send"] == m["recv"] == 0 for m in moved), moved
    assert all(cl.calls[r]["send"] == cl.calls[r]["recv"] == 1 for r in range(3)), cl.calls


def test_a_peer_hung_in_a_device_exchange_fails_it_on_every_rank_within_its_timeout() -> None:
    data = FakeNcclWorld(2, CPU, timeout_s=0.5)
    data.hang(1)
    xs = inputs([0, 1], torch.float32, (DEVICE_P2P_MIN_BYTES // 4, 2), seed=9)
    cl, results, _ = _exchange_on(data, [(0, 1), (1, 0)], xs)
    assert not any(isinstance(r, OpResult) for r in results), results
    assert "timed out on the device" in str(results[1]), results[1]
    assert all(ctx.store.peek("y") is None for ctx in cl.ctxs)


# ------------------------------------------------------------------ sub-groups
def test_a_sub_group_is_split_from_the_world_communicator_and_aborted_on_destroy(
    seed: int,
) -> None:
    """new_group on an NCCL world: every rank takes part in one split of the world's
    communicator (members with the group's color, the non-member with none), the
    members' data group is the split's, it carries collectives, and destroy_group
    aborts it and leaves the world's communicator alone."""
    data = FakeNcclWorld(3, CPU)
    cl = Cluster(3, data=data, tcp_store=dist.HashStore(), nccl=split_factory)  # type: ignore[arg-type]
    made = cl.run(
        worker_pb2.OpDescriptor(
            kind=OpKind.NEW_GROUP, group_id=4, new_group=worker_pb2.NewGroupArgs(ranks=[2, 0])
        )
    )
    assert all(isinstance(r, OpResult) for r in made), made
    assert data.splits == [[4], [NOCOLOR], [4]]
    (sub,) = data.subs.values()
    for index, r in enumerate([0, 2]):
        handles = cl.ctxs[r].groups[4].handles
        assert isinstance(handles.data, CompletingGroup)
        assert handles.data.wrapped is sub.raw(index)
        assert sub.calls[index]["allreduce"] == 1  # connected when made
    xs = inputs([0, 2], torch.float32, (6, 1 << 14), seed=seed)
    cl.put("x", xs)
    results = cl.tensor_op(OpKind.ALL_REDUCE, group_id=4, name="x", out="y", op=0)
    assert all(isinstance(r, OpResult) for r in results), results
    for r in (0, 2):
        assert torch.allclose(cl.ctxs[r].store.peek("y"), xs[0] + xs[2]), r
    assert cl.ctxs[1].store.peek("y") is None
    destroyed = cl.run(
        worker_pb2.OpDescriptor(
            kind=OpKind.DESTROY_GROUP, destroy_group=worker_pb2.DestroyGroupArgs(group_id=4)
        )
    )
    assert all(isinstance(r, OpResult) for r in destroyed), destroyed
    assert [s.aborts for s in sub.states] == [1, 1]
    assert [s.aborts for s in data.states] == [0, 0, 0]


def test_a_split_without_every_rank_never_completes() -> None:
    """The fake holds NCCL to its rule: members splitting alone wait for the rest."""
    data = FakeNcclWorld(3, CPU, timeout_s=0.3)
    results = run_ranks(data, lambda r, pg: pg.split(7) if r != 1 else None)
    assert isinstance(results[0], RuntimeError) and "timed out" in str(results[0]), results
