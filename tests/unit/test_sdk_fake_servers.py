"""The client SDK and the ``collectives`` CLI on the wire, against fake servers.

Framing, OpOptions, retries, deadlines and the membership watch, against
in-process fake servers on loopback (``sdk_fakes``). The pure parts are in
test_sdk.py; end-to-end tests against real workers live in tests/integration.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
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
from sdk_fakes import invalid as _invalid

import collectives
from collectives.cli.main import main as cli_main

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
    """An op runs in its generation: "never started" is not enough when the membership changed."""
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
        "TENSORS", "MODELS", "OPS_OK", "OPS_FAILED", "QUEUE", "MEMORY", "LAST_OP",
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
    importlib.util.find_spec("collectives_server.cli.main") is None,
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
        script = [sys.executable, "-m", "collectives.cli.main", "status", "--coordinator", address]
        done = subprocess.run([*script, "--json"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["formed"] is False and doc["workers"] == [] and doc["status"]
        done = subprocess.run(script, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "formed no" in done.stdout
    finally:
        server.terminate()
        server.wait(20)
