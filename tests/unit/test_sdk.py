"""The client SDK (``import collectives``) and the ``collectives`` CLI, without a real cluster.

Pure parts (the public surface, validation, Work, WorkerInfo mapping) are
tested directly; the wire behaviour (framing, OpOptions, retries, deadlines,
the membership watch) against in-process fake servers on loopback
(``sdk_fakes``). End-to-end tests against real workers live in tests/integration.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import inspect
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers import wait_until
from sdk_fakes import FakeDeployment, start_deployment

import collectives
from collectives import _validation as v
from collectives.cli import main as cli_main
from collectives.errors import CollectiveError
from collectives.v1 import coordinator_pb2
from collectives.workers import ClusterSnapshot, WorkerInfo, WorkerState

# ---------------------------------------------------------------- public surface

EXPECTED_EXPORTS = {
    "Cluster",
    "CollectiveError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Group",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ReduceOp",
    "ResourceExhausted",
    "Unavailable",
    "Work",
    "WorkerInfo",
    "WorkerState",
    "__version__",
    "connect",
}

_E = inspect.Parameter.empty
# (name, default) of every parameter after self, as the contract fixes them.
EXPECTED_SIGNATURES: dict[str, list[tuple[str, object]]] = {
    "put": [("name", _E), ("t", _E), ("rank", None), ("timeout", None)],
    "get": [("name", _E), ("rank", 0), ("timeout", None)],
    "delete": [("name", _E), ("rank", None), ("missing_ok", False), ("timeout", None)],
    "scatter": [("name", _E), ("t", _E), ("dim", 0), ("chunk_sizes", None), ("timeout", None)],
    "broadcast": [
        ("name", _E), ("src", 0), ("group", None), ("async_op", False), ("timeout", None),
    ],
    "all_reduce": [
        ("name", _E), ("op", "sum"), ("group", None), ("out", None), ("async_op", False),
        ("timeout", None),
    ],
    "reduce": [
        ("name", _E), ("dst", 0), ("op", "sum"), ("group", None), ("out", None),
        ("async_op", False), ("timeout", None),
    ],
    "all_gather": [
        ("name", _E), ("out", None), ("group", None), ("async_op", False), ("timeout", None),
    ],
    "gather": [
        ("name", _E), ("dst", 0), ("out", None), ("group", None), ("async_op", False),
        ("timeout", None),
    ],
    "reduce_scatter": [
        ("name", _E), ("op", "sum"), ("out", None), ("group", None), ("async_op", False),
        ("timeout", None),
    ],
    "all_to_all": [
        ("name", _E), ("out", None), ("group", None), ("async_op", False), ("timeout", None),
    ],
    "barrier": [("group", None), ("async_op", False), ("timeout", None)],
    "new_group": [("ranks", _E), ("timeout", None)],
    "workers": [],
    "close": [],
}  # fmt: skip


def test_exports_match_the_contract() -> None:
    assert set(collectives.__all__) == EXPECTED_EXPORTS
    for name in collectives.__all__:
        assert hasattr(collectives, name), name
    assert issubclass(collectives.InvalidArgument, collectives.CollectiveError)
    assert issubclass(collectives.InvalidArgument, ValueError)
    assert issubclass(collectives.DeadlineExceeded, TimeoutError)


@pytest.mark.parametrize("method", sorted(EXPECTED_SIGNATURES))
def test_cluster_method_signatures(method: str) -> None:
    params = list(inspect.signature(getattr(collectives.Cluster, method)).parameters.values())
    assert params[0].name == "self"
    assert [(p.name, p.default) for p in params[1:]] == EXPECTED_SIGNATURES[method]


def test_connect_signature_and_cluster_protocol() -> None:
    sig = inspect.signature(collectives.connect)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in positional] == [("address", _E), ("timeout", 30.0)]
    # Security settings (docs/security.md) and the shared-memory fast path are
    # keyword-only extensions, all optional.
    assert [(p.name, p.default) for p in params[len(positional) :]] == [
        ("token", None),
        ("tls_ca", None),
        ("tls_cert", None),
        ("tls_key", None),
        ("tls", None),
        ("shared_memory", None),
    ]
    for prop in ("world_size", "generation", "formed", "leader", "op_timeout_s"):
        assert isinstance(inspect.getattr_static(collectives.Cluster, prop), property), prop
    assert hasattr(collectives.Cluster, "__enter__") and hasattr(collectives.Cluster, "__exit__")
    for name in ("result", "wait", "done", "exception"):
        assert callable(getattr(collectives.Work, name))


def test_reduce_op_parsing() -> None:
    reduce_op = collectives.ReduceOp
    assert [m.name for m in reduce_op] == [
        "SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR",
    ]  # fmt: skip
    assert v.check_op("sum") is reduce_op.SUM
    assert v.check_op(" Max ") is reduce_op.MAX
    assert v.check_op(reduce_op.BXOR) is reduce_op.BXOR
    if torch.distributed.is_available():
        assert v.check_op(torch.distributed.ReduceOp.PRODUCT) is reduce_op.PRODUCT
    for bad in ("mean", "", 3, None):
        with pytest.raises(collectives.InvalidArgument) as info:
            v.check_op(bad)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- client-side validation


def _invalid(fn, *args, match: str | None = None, **kwargs) -> collectives.InvalidArgument:
    with pytest.raises(collectives.InvalidArgument, match=match) as info:
        fn(*args, **kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def test_names_tensors_and_timeouts() -> None:
    assert v.check_name("a/b.c:d-e_1") == "a/b.c:d-e_1"
    _invalid(v.check_name, "", match="empty")
    _invalid(v.check_name, "a b", match="' '")
    _invalid(v.check_name, "x" * 257, match="257")
    _invalid(v.check_name, 5, match="str")
    assert v.check_out(None) == ""
    _invalid(v.check_out, "bad name", match="out name")
    _invalid(v.check_tensor, [1, 2], match="torch.Tensor")
    _invalid(v.check_tensor, torch.zeros(2, dtype=torch.uint16), match="not supported")
    _invalid(v.check_tensor, torch.zeros(2).to_sparse(), match="dense")
    _invalid(v.check_tensor, torch.zeros(2, device="meta"), match="meta")
    assert v.check_timeout(None, 7.0) == 7.0
    assert v.check_timeout(2, 7.0) == 2.0
    for bad in (0, -1, float("inf"), float("nan"), "3", True):
        _invalid(v.check_timeout, bad, 7.0)


def test_ranks_roots_and_groups() -> None:
    assert v.check_rank(3, 4) == 3
    err = _invalid(v.check_rank, 4, 4)
    assert "0..3" in err.message and "world size 4" in err.message
    _invalid(v.check_rank, -1, 4, match="out of range")
    _invalid(v.check_rank, True, 4, match="int")
    group = collectives.Group(id=7, ranks=(1, 3), generation=2)
    assert v.check_root("reduce", 3, 4, group) == 3
    _invalid(v.check_root, "broadcast", 0, 4, group, match=r"src 0 is not a member .*\[1, 3\]")
    _invalid(v.check_root, "broadcast", 9, 4, None, match="src 9 is out of range")
    _invalid(v.check_group, [0, 1], match="new_group")
    assert v.check_group(None) is None and v.check_group(group) is group
    assert v.check_new_group_ranks([3, 1], 4) == [1, 3]
    _invalid(v.check_new_group_ranks, [], 4, match="at least one")
    _invalid(v.check_new_group_ranks, [1, 1], 4, match="distinct")
    _invalid(v.check_new_group_ranks, [0, 4], 4, match="out of range")
    _invalid(v.check_new_group_ranks, "01", 4, match="list")
    assert 3 in group and 0 not in group and group.size == 2 and group.group_rank(3) == 1


def test_scatter_parts_follow_tensor_split_and_split() -> None:
    t = torch.arange(10).reshape(5, 2)
    parts = v.scatter_parts(t, 3)
    assert [p.shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat(parts), t)
    parts = v.scatter_parts(t, 2, dim=1)
    assert [p.tolist() for p in parts] == [t[:, :1].tolist(), t[:, 1:].tolist()]
    parts = v.scatter_parts(t, 3, chunk_sizes=[0, 4, 1])
    assert [p.shape[0] for p in parts] == [0, 4, 1]
    assert [p.shape[0] for p in v.scatter_parts(t, 7)] == [1, 1, 1, 1, 1, 0, 0]
    _invalid(v.scatter_parts, t, 3, chunk_sizes=[2, 3], match="2 entries but the world size is 3")
    _invalid(v.scatter_parts, t, 3, chunk_sizes=[1, 1, 1], match="sum to 3")
    _invalid(v.scatter_parts, t, 3, chunk_sizes=[6, -1, 0], match="non-negative")
    _invalid(v.scatter_parts, t, 3, dim=2, match="out of range")
    _invalid(v.scatter_parts, torch.tensor(1.0), 3, match="0-dimensional")


# ---------------------------------------------------------------- Work


def test_work_returns_what_the_call_returns() -> None:
    future: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
    work = collectives.Work(future, "gather 'x'")
    assert not work.done()
    start = time.monotonic()
    with pytest.raises(collectives.DeadlineExceeded, match=r"did not finish within 0\.05"):
        work.result(timeout=0.05)
    assert time.monotonic() - start < 2
    with pytest.raises(collectives.DeadlineExceeded):
        work.exception(timeout=0.01)
    future.set_result([1, 2])
    assert work.done() and work.is_completed()
    assert work.result() == [1, 2] and work.wait(timeout=1) == [1, 2]
    assert work.exception() is None


def test_work_raises_the_ops_own_error() -> None:
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    own = collectives.DeadlineExceeded("the op timed out on the server")
    future.set_exception(own)
    work = collectives.Work(future)
    with pytest.raises(collectives.DeadlineExceeded) as info:
        work.wait(timeout=1)
    assert info.value is own
    assert work.exception() is own
    cancelled: concurrent.futures.Future[None] = concurrent.futures.Future()
    cancelled.cancel()
    with pytest.raises(collectives.Unavailable, match="closed"):
        collectives.Work(cancelled, "barrier").result()


# ---------------------------------------------------------------- WorkerInfo mapping


def test_worker_info_from_cluster_message() -> None:
    msg = coordinator_pb2.Cluster(
        generation=3,
        formed=True,
        ready=True,
        world_size=2,
        version=9,
        status="formed",
        op_timeout_s=12.0,
        workers=[
            coordinator_pb2.WorkerInfo(
                worker_id="a", rank=0, address="h1:1", hostname="h1", pid=11,
                state=coordinator_pb2.WORKER_STATE_BUSY, devices=["cuda:0", "cuda:1"],
                joined_generation=3, last_heartbeat_age_s=0.5, backend="nccl",
                uptime_s=60.0, version="0.1.0",
            ),
            coordinator_pb2.WorkerInfo(
                worker_id="b", rank=1, address="h2:1", state=coordinator_pb2.WORKER_STATE_READY,
                devices=["cpu"], joined_generation=3,
            ),
            coordinator_pb2.WorkerInfo(
                worker_id="c", rank=-1, address="h3:1", devices=["cpu"],
                state=coordinator_pb2.WORKER_STATE_UNSPECIFIED,
            ),
        ],
    )  # fmt: skip
    snap = ClusterSnapshot.from_proto(msg)
    first = snap.workers[0]
    assert first == WorkerInfo(
        rank=0, address="h1:1", state=WorkerState.BUSY, devices=["cuda:0", "cuda:1"],
        hostname="h1", pid=11, worker_id="a", generation=3, last_heartbeat_age_s=0.5,
        backend="nccl", uptime_s=60.0, version="0.1.0",
    )  # fmt: skip
    assert first.state == "busy" and isinstance(first.state, str) and str(first.state) == "busy"
    assert [w.state for w in snap.workers] == ["busy", "ready", "joining"]
    assert [w.rank for w in snap.members] == [0, 1] and not snap.workers[2].is_member
    assert snap.leader_address == "h1:1" and snap.address_of(1) == "h2:1"
    assert snap.op_timeout_s == 12.0
    _invalid(snap.address_of, 2, match="0..1")
    assert json.loads(json.dumps(snap.to_dict()))["workers"][0]["state"] == "busy"
    assert {s.value for s in WorkerState} == {"joining", "ready", "busy", "draining", "lost"}
    unformed = ClusterSnapshot.from_proto(coordinator_pb2.Cluster(status="waiting for 1 more"))
    assert unformed.leader_address is None and unformed.op_timeout_s == 30.0
    with pytest.raises(collectives.Unavailable, match="waiting for 1 more"):
        unformed.require_formed()


# ---------------------------------------------------------------- nothing listening


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connect_to_nothing_fails_within_its_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        collectives.connect(f"127.0.0.1:{_unused_port()}", timeout=2)
    assert time.monotonic() - start < 3.5
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    _invalid(collectives.connect, "", match="host:port")


def test_status_cli_against_nothing_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    code = cli_main(["status", "--coordinator", f"127.0.0.1:{_unused_port()}", "--timeout", "1"])
    assert code == 2 and time.monotonic() - start < 3
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot reach the coordinator" in captured.err


# ---------------------------------------------------------------- against fake servers


@pytest.fixture
def deployment() -> Iterator[FakeDeployment]:
    d = start_deployment(world_size=2)
    yield d
    d.stop()


@pytest.fixture
def cluster(deployment: FakeDeployment) -> Iterator[collectives.Cluster]:
    with collectives.connect(deployment.coordinator_address, timeout=10) as c:
        yield c


def test_connect_follows_the_coordinator(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    assert (cluster.world_size, cluster.generation, cluster.formed) == (2, 1, True)
    assert cluster.leader == deployment.worker_addresses[0]
    assert cluster.default_timeout_s == pytest.approx(15.0)  # op_timeout_s 10 + margin
    workers = cluster.workers()
    assert [w.rank for w in workers] == [0, 1, -1]
    assert [w.state for w in workers] == ["ready", "ready", "lost"]
    assert workers[2].devices == ["cuda:0", "cuda:1"]
    deployment.fake.generation = 2
    deployment.coordinator.publish(deployment.formed_cluster(generation=2))
    wait_until(lambda: cluster.generation == 2, 10, "the watch to deliver generation 2")
    cluster.close()
    cluster.close()  # idempotent
    with pytest.raises(collectives.Unavailable, match="closed"):
        cluster.barrier()


def test_connect_waits_for_formation_and_quotes_the_status() -> None:
    d = start_deployment(world_size=1, formed=False)
    try:
        with pytest.raises(collectives.DeadlineExceeded, match="waiting for 2 more workers"):
            collectives.connect(d.coordinator_address, timeout=0.5)
        # Formation announced while connect() waits: it returns as soon as it hears.
        d.coordinator.watch_opened.clear()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(collectives.connect, d.coordinator_address, 10)
            assert d.coordinator.watch_opened.wait(10)
            assert not pending.done()
            d.coordinator.publish(d.formed_cluster())
            with pending.result(timeout=10) as c:
                assert c.formed and c.world_size == 1
    finally:
        d.stop()


DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[collectives.Cluster]:
    """One fake deployment for the stateless round-trip cases (closing a channel takes ~0.2 s)."""
    d = start_deployment(world_size=2)
    try:
        with collectives.connect(d.coordinator_address, timeout=10) as c:
            yield c
    finally:
        d.stop()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_put_get_round_trip(shared_cluster: collectives.Cluster, dtype: torch.dtype) -> None:
    cluster = shared_cluster
    t = (torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) - 7).to(dtype)
    cluster.put("x", t.transpose(0, 2), rank=1)  # non-contiguous input
    got = cluster.get("x", rank=1)
    assert got.dtype == dtype and torch.equal(got, t.transpose(0, 2))


def test_put_everywhere_large_and_empty(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    big = torch.randn(5 * 1024 * 1024 // 4 + 3)  # spans two 4 MiB chunks
    cluster.put("big", big)
    assert all(torch.equal(store["big"], big) for store in deployment.fake.stores)
    assert torch.equal(cluster.get("big", rank=1), big)
    cluster.put("empty", torch.zeros(0, 3))
    assert cluster.get("empty").shape == (0, 3)


def test_validation_happens_before_any_rpc(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    _invalid(cluster.put, "bad name", torch.ones(1))
    _invalid(cluster.put, "x", [1.0])
    _invalid(cluster.put, "x", torch.ones(1), rank=2, match=r"valid ranks are 0\.\.1")
    _invalid(cluster.get, "x", rank=-1)
    _invalid(cluster.scatter, "x", torch.ones(4), chunk_sizes=[4])
    _invalid(cluster.all_reduce, "x", op="mean", async_op=True)
    _invalid(cluster.reduce, "x", dst=5, async_op=True)
    _invalid(cluster.broadcast, "x", timeout=-1)
    _invalid(cluster.new_group, [0, 0])
    assert not any(deployment.fake.requests.values())


def test_get_missing_and_delete_semantics(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    with pytest.raises(collectives.NotFound, match="'nope'"):
        cluster.get("nope", rank=1)
    cluster.put("d", torch.ones(2), rank=1)
    cluster.delete("d")  # exists on rank 1 only: fine
    assert all("d" not in store for store in deployment.fake.stores)
    with pytest.raises(collectives.NotFound, match="does not exist"):
        cluster.delete("d")
    cluster.delete("d", missing_ok=True)
    with pytest.raises(collectives.NotFound):
        cluster.delete("d", rank=0)


def test_scatter_places_part_i_on_rank_i(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    t = torch.arange(12.0).reshape(3, 4)
    cluster.scatter("s", t)
    assert [s["s"].shape[0] for s in deployment.fake.stores] == [2, 1]
    cluster.scatter("s", t, dim=1, chunk_sizes=[1, 3])
    assert torch.equal(cluster.get("s", rank=1), t[:, 1:])


def test_collectives_send_op_options_and_return_results(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    fake = deployment.fake
    cluster.put("v", torch.tensor([1.0, 2.0]), rank=0)
    cluster.put("v", torch.tensor([3.0, 4.0]), rank=1)
    assert cluster.all_reduce("v", op=collectives.ReduceOp.SUM, out="s", timeout=4) is None
    request = fake.requests["AllReduce"][-1]
    assert request.options.generation == 1 and request.options.group_id == 0
    assert 0 < request.options.timeout_s <= 4
    assert request.op == collectives.ReduceOp.SUM.wire and request.out == "s"
    assert torch.equal(cluster.get("s", rank=1), torch.tensor([4.0, 6.0]))
    assert torch.equal(cluster.reduce("v", dst=1, out="r"), torch.tensor([4.0, 6.0]))
    parts = cluster.all_gather("v", out="g")
    assert [p.tolist() for p in parts] == [[1.0, 2.0], [3.0, 4.0]]
    assert [p.tolist() for p in cluster.gather("v", dst=1)] == [[1.0, 2.0], [3.0, 4.0]]
    assert cluster.broadcast("s", src=1) is None and cluster.barrier() is None
    assert cluster.reduce_scatter("s") is None and cluster.all_to_all("s") is None


def test_groups_and_async_ops(deployment: FakeDeployment, cluster: collectives.Cluster) -> None:
    cluster.put("a", torch.ones(3))
    group = cluster.new_group([1])
    assert group.ranks == (1,) and group.generation == 1
    _invalid(cluster.reduce, "a", dst=0, group=group, match="not a member")
    work = cluster.reduce("a", dst=1, group=group, async_op=True)
    assert isinstance(work, collectives.Work)
    assert torch.equal(work.wait(timeout=10), torch.ones(3))
    assert deployment.fake.requests["Reduce"][-1].options.group_id == group.id
    works = [cluster.all_reduce("a", async_op=True) for _ in range(3)]
    assert [w.result(timeout=10) for w in works] == [None, None, None]
    assert torch.equal(cluster.get("a"), torch.full((3,), 8.0))  # 1+1, 2+2, 4+4
    # After a generation change the group's ranks may be other workers: refused.
    deployment.coordinator.publish(deployment.formed_cluster(generation=2))
    wait_until(lambda: cluster.generation == 2, 10, "generation 2")
    with pytest.raises(collectives.Unavailable, match="new_group"):
        cluster.barrier(group=group)


def test_a_never_started_collective_is_not_retried_on_a_new_generation(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    """Issue 10: "never started" is not enough when the membership changed."""
    fake = deployment.fake
    cluster.put("r", torch.ones(2))
    gate = threading.Event()
    fake.block["AllReduce"] = gate
    fake.fail_next("AllReduce", grpc.StatusCode.UNAVAILABLE, executed="no")
    work = cluster.all_reduce("r", async_op=True)
    wait_until(lambda: len(fake.requests["AllReduce"]) == 1, 10, "the op to reach the leader")
    assert work.generation == 1
    # While the leader holds the op, the cluster moves to generation 2.
    fake.generation = 2
    deployment.coordinator.publish(deployment.formed_cluster(generation=2))
    wait_until(lambda: cluster.generation == 2, 10, "the watch to deliver generation 2")
    del fake.block["AllReduce"]
    gate.set()
    with pytest.raises(collectives.Unavailable) as info:
        work.wait(10)
    err = info.value
    assert err.executed is False and err.generation == 1
    assert "generation 1" in err.message and "generation 2" in err.message
    assert "Nothing was committed" in err.message
    assert len(fake.requests["AllReduce"]) == 1  # not sent again
    # A new call binds to the new generation and runs.
    work = cluster.all_reduce("r", async_op=True)
    assert work.wait(10) is None and work.generation == 2
    assert fake.requests["AllReduce"][-1].options.generation == 2


def test_only_never_started_collectives_are_retried(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    fake = deployment.fake
    cluster.put("r", torch.ones(2))
    fake.fail_next("AllReduce", grpc.StatusCode.UNAVAILABLE, executed="no")
    gets = deployment.coordinator.get_calls
    cluster.all_reduce("r")
    assert len(fake.requests["AllReduce"]) == 2  # retried once...
    assert deployment.coordinator.get_calls > gets  # ...after refreshing the cluster
    fake.fail_next("AllReduce", grpc.StatusCode.UNAVAILABLE)  # may have run: not retried
    with pytest.raises(collectives.Unavailable) as info:
        cluster.all_reduce("r")
    assert info.value.executed is None and len(fake.requests["AllReduce"]) == 3
    assert torch.equal(cluster.get("r"), torch.full((2,), 2.0))
    fake.fail_next("GetTensor", grpc.StatusCode.UNAVAILABLE)  # reads are retried
    assert torch.equal(cluster.get("r"), torch.full((2,), 2.0))
    fake.fail_next("AllReduce", grpc.StatusCode.FAILED_PRECONDITION, executed="no")
    with pytest.raises(collectives.FailedPrecondition):  # would fail again: not retried
        cluster.all_reduce("r")
    assert len(fake.requests["AllReduce"]) == 4


def test_deadline_expiry_is_deadline_exceeded(
    deployment: FakeDeployment, cluster: collectives.Cluster
) -> None:
    gate = deployment.fake.block["Barrier"] = threading.Event()
    try:
        start = time.monotonic()
        with pytest.raises(collectives.DeadlineExceeded):
            cluster.barrier(timeout=0.5)
        assert time.monotonic() - start < 3
        work = cluster.barrier(timeout=0.5, async_op=True)
        with pytest.raises(collectives.DeadlineExceeded):
            work.result(timeout=5)
    finally:
        gate.set()


# ---------------------------------------------------------------- CLI


def test_status_cli_table_and_json(
    deployment: FakeDeployment,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address = deployment.coordinator_address
    assert cli_main(["status", "--coordinator", address, "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "generation 1" in lines[0] and "world size 2" in lines[0] and "formed yes" in lines[0]
    assert lines[1].startswith("status: ")
    lines = lines[1:]
    assert lines[1].split() == [
        "RANK", "STATE", "ADDRESS", "HOSTNAME", "PID", "DEVICES", "JOINED_GEN", "HEARTBEAT",
        "TENSORS", "OPS_OK", "OPS_FAILED", "QUEUE", "MEMORY", "LAST_OP",
    ]  # fmt: skip
    assert lines[2].split()[:3] == ["0", "ready", deployment.worker_addresses[0]]
    assert lines[4].split()[:2] == ["-", "lost"] and "cuda:0,cuda:1" in lines[4]
    assert len({line.index("STATE") for line in lines[1:2]}) == 1
    assert lines[2].index("ready") == lines[1].index("STATE")  # aligned
    # Without --wide the table fits 80 columns, keeping the columns that matter most.
    monkeypatch.setenv("COLUMNS", "80")
    assert cli_main(["status", "--coordinator", address]) == 0
    narrow = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in narrow) <= 80, narrow
    assert narrow[2].split()[:3] == ["RANK", "STATE", "ADDRESS"] and "TENSORS" in narrow[2]
    assert any("--wide shows all" in line for line in narrow)
    assert cli_main(["status", "--coordinator", address, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["generation"] == 1 and doc["world_size"] == 2 and doc["formed"] is True
    assert [w["state"] for w in doc["workers"]] == ["ready", "ready", "lost"]


@pytest.mark.skipif(
    importlib.util.find_spec("collectives_server.cli") is None,
    reason="needs the collectives-server CLI (python -m collectives_server coordinator)",
)
def test_status_console_script_against_a_real_coordinator() -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "collectives_server", "coordinator", "--port", "0",
         "--world-size", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        address = server.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), address
        script = [sys.executable, "-m", "collectives.cli", "status", "--coordinator", address]
        done = subprocess.run([*script, "--json"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["formed"] is False and doc["workers"] == [] and doc["status"]
        done = subprocess.run(script, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "formed no" in done.stdout
    finally:
        server.terminate()
        server.wait(20)
