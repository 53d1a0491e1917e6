"""The client SDK's pure parts (``import collectives``), without any server.

The public surface, client-side validation, Work, the WorkerInfo mapping, and
what connect() and the ``collectives`` CLI do when nothing is listening. The
wire behaviour against in-process fake servers is in test_sdk_fake_servers.py;
end-to-end tests against real workers live in tests/integration.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import socket
import time

import grpc
import pytest
import torch
from sdk_fakes import invalid as _invalid

import collectives
from collectives import _validation as v
from collectives.cli.main import main as cli_main
from collectives.errors import CollectiveError
from collectives.v1 import coordinator_pb2
from collectives.wire.cluster_state import ClusterSnapshot, WorkerInfo, WorkerState

# ---------------------------------------------------------------- public surface

EXPECTED_EXPORTS = {
    "Batching",
    "Cluster",
    "CollectiveError",
    "DataParallel",
    "DeadlineExceeded",
    "DrainReport",
    "FailedPrecondition",
    "Group",
    "InvalidArgument",
    "NotFound",
    "OpRecord",
    "PermissionDenied",
    "RankPhases",
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
    "drain": [("worker", _E), ("shrink", False), ("timeout", None)],
    "put": [("name", _E), ("t", _E), ("rank", None), ("timeout", None)],
    "get": [("name", _E), ("rank", 0), ("timeout", None), ("out", None)],
    "delete": [("name", _E), ("rank", None), ("missing_ok", False), ("timeout", None)],
    "scatter": [
        ("name", _E), ("t", _E), ("dim", 0), ("chunk_sizes", None), ("timeout", None),
        ("group", None), ("async_op", False),
    ],
    "broadcast": [
        ("name", _E), ("src", 0), ("group", None), ("async_op", False), ("timeout", None),
        ("out", None),
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
        ("split_sizes", None),
    ],
    "barrier": [("group", None), ("async_op", False), ("timeout", None)],
    "new_group": [("ranks", _E), ("timeout", None)],
    "workers": [],
    "close": [],
    # point to point and group teardown
    "send": [
        ("name", _E), ("src", _E), ("dst", _E), ("out", None), ("group", None),
        ("async_op", False), ("timeout", None),
    ],
    "exchange": [
        ("name", _E), ("pairs", _E), ("out", None), ("group", None), ("async_op", False),
        ("timeout", None),
    ],
    "destroy_group": [("group", _E), ("timeout", None)],
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
    # address None: COLLECTIVES_COORDINATOR (issue 44)
    assert [(p.name, p.default) for p in positional] == [("address", None), ("timeout", 30.0)]
    # Security settings (docs/security.md), the shared-memory fast path and
    # progress bars are keyword-only extensions, all optional.
    assert [(p.name, p.default) for p in params[len(positional) :]] == [
        ("token", None),
        ("tls_ca", None),
        ("tls_cert", None),
        ("tls_key", None),
        ("tls", None),
        ("shared_memory", None),
        ("progress", None),
        ("name", None),
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
    assert {s.value for s in WorkerState} == {
        "joining",
        "ready",
        "busy",
        "draining",
        "lost",
        "spare",
    }
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


def test_status_cli_takes_the_coordinator_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    address = f"127.0.0.1:{_unused_port()}"
    monkeypatch.setenv("COLLECTIVES_COORDINATOR", address)
    assert cli_main(["status", "--timeout", "1"]) == 2
    assert address in capsys.readouterr().err  # it dialled the variable's address
    monkeypatch.delenv("COLLECTIVES_COORDINATOR")
    with pytest.raises(SystemExit):
        cli_main(["status", "--timeout", "1"])  # neither flag nor variable: a usage error
