"""Cluster-side training: remote autograd, bucketed gradient aggregation, optimizers.

Five remote steps equal five local full-batch steps
on every rank (SGD and Adam; train_step too), the number of collectives per
all_reduce_gradients is the number of buckets, and forwards without backward
do not grow worker memory.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import grpc
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from helpers import wait_until
from torch import nn

from collectives.v1 import worker_pb2, worker_pb2_grpc

RTOL, ATOL = 1e-4, 1e-6


def _model(gen: torch.Generator, width: int = 24) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3))


def _stub(address: str) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))


def _assert_replicas_equal(cluster, name: str, local: nn.Module) -> None:
    reference = None
    for rank in range(cluster.world_size):
        state = cluster.state_dict(name, rank=rank)
        for key, value in local.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)
        if reference is None:
            reference = state
        else:  # replicas are bit-identical, not just close
            assert all(torch.equal(state[k], reference[k]) for k in reference)


@pytest.mark.parametrize(
    ("optimizer", "hyper"),
    [("sgd", {"lr": 0.1, "momentum": 0.9}), ("adam", {"lr": 0.01})],
)
def test_five_remote_steps_equal_five_local_steps(cluster3, gen, uname, optimizer, hyper) -> None:
    model = _model(gen)
    local = copy.deepcopy(model)
    local_opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer](
        local.parameters(), **hyper
    )
    name = uname("train")
    cluster3.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    dp = cluster3.data_parallel(name)
    x = torch.randn(12, 6, generator=gen)
    y = torch.randn(12, 3, generator=gen)
    for _ in range(5):
        cluster3.zero_grad(name)
        F.mse_loss(dp(x), y).backward()
        cluster3.all_reduce_gradients(name, op="sum")
        local_opt.zero_grad()
        F.mse_loss(local(x), y).backward()
        for rank in range(3):
            grads = cluster3.gradients(name, rank=rank)
            assert set(grads) == {n for n, _ in local.named_parameters()}
            for n, p in local.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=RTOL, atol=ATOL)
        cluster3.step(name, optimizer=optimizer, **hyper)
        local_opt.step()
    _assert_replicas_equal(cluster3, name, local)


def test_a_worker_without_a_shard_contributes_zero_gradients(cluster3, gen, uname) -> None:
    model = _model(gen)
    local = copy.deepcopy(model)
    name = uname("small")
    cluster3.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    x, y = torch.randn(2, 6, generator=gen), torch.randn(2, 3, generator=gen)  # 2 rows, 3 workers
    cluster3.zero_grad(name)
    F.mse_loss(cluster3.data_parallel(name)(x), y).backward()
    assert cluster3.gradients(name, rank=2) == {}  # rank 2 got no shard
    cluster3.all_reduce_gradients(name, op="sum")
    F.mse_loss(local(x), y).backward()
    for rank in range(3):
        grads = cluster3.gradients(name, rank=rank)
        for n, p in local.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_train_step_matches_local_full_batch(cluster3, gen, uname, loss) -> None:
    model = _model(gen)
    local = copy.deepcopy(model)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.2)
    name = uname("ddp")
    cluster3.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    x = torch.randn(12, 6, generator=gen)  # equal shards of 4
    if loss == "mse":
        y = torch.randn(12, 3, generator=gen)
        loss_fn = F.mse_loss
    else:
        y = torch.randint(0, 3, (12,), generator=gen)
        loss_fn = F.cross_entropy
    xs, ys = uname("x"), uname("y")
    cluster3.scatter(xs, x)
    cluster3.scatter(ys, y)
    for _ in range(5):
        remote_loss = cluster3.train_step(name, xs, ys, loss=loss, optimizer="sgd", lr=0.2)
        local_opt.zero_grad()
        local_loss = loss_fn(local(x), y)
        local_loss.backward()
        local_opt.step()
        assert remote_loss == pytest.approx(float(local_loss.detach()), rel=RTOL)
    _assert_replicas_equal(cluster3, name, local)


def test_both_step_paths_keep_momentum_across_an_lr_change(cluster3, gen, uname) -> None:
    """step() (each worker) and train_step (sequenced by the leader) share one optimizer
    rule: a new lr keeps SGD's momentum, as changing param_groups[0]["lr"] does in torch."""
    model = _model(gen)
    local = copy.deepcopy(model)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    stepped, trained = uname("stepped"), uname("trained")
    for name in (stepped, trained):
        cluster3.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    dp = cluster3.data_parallel(stepped)
    xs, ys = uname("x"), uname("y")
    hyper = {"lr": 0.1, "momentum": 0.9}
    for i in range(6):
        if i == 3:
            hyper = {"lr": 0.03, "momentum": 0.9}
            local_opt.param_groups[0]["lr"] = 0.03
        x = torch.randn(12, 6, generator=gen)  # fresh data every step; equal shards of 4
        y = torch.randn(12, 3, generator=gen)
        cluster3.zero_grad(stepped)
        F.mse_loss(dp(x), y).backward()
        cluster3.all_reduce_gradients(stepped, op="sum")
        cluster3.step(stepped, optimizer="sgd", **hyper)
        cluster3.scatter(xs, x)
        cluster3.scatter(ys, y)
        cluster3.train_step(trained, xs, ys, loss="mse", optimizer="sgd", **hyper)
        local_opt.zero_grad()
        F.mse_loss(local(x), y).backward()
        local_opt.step()
    _assert_replicas_equal(cluster3, stepped, local)
    _assert_replicas_equal(cluster3, trained, local)


def _expected_buckets(model: nn.Module, bucket_bytes: int) -> int:
    buckets, size = 0, 0
    for p in reversed(list(model.parameters())):
        nbytes = p.numel() * p.element_size()
        if size and size + nbytes > bucket_bytes:
            buckets, size = buckets + 1, 0
        size += nbytes
    return buckets + (1 if size else 0)


def _counters(cluster) -> list[tuple[int, int]]:
    result = []
    for w in sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank):
        status = _stub(w.address).GetState(worker_pb2.GetStateRequest(), timeout=10).status
        result.append((status.data_collectives, status.gradient_buckets_reduced))
    return result


@pytest.mark.parametrize("bucket_bytes", [1024, 4096, None])
def test_collectives_per_all_reduce_gradients_equal_buckets(
    cluster2, gen, uname, bucket_bytes
) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(25)))  # 50 parameter tensors
    assert len(list(model.parameters())) >= 50
    name = uname("deep")
    cluster2.load_model(name, model, example_inputs=(torch.randn(4, 8),))
    cluster2.data_parallel(name)(torch.randn(6, 8, generator=gen)).sum().backward()
    before = _counters(cluster2)
    cluster2.all_reduce_gradients(name, op="sum", bucket_bytes=bucket_bytes)
    expected = _expected_buckets(model, bucket_bytes or 25 * 1024 * 1024)
    assert expected < 50

    def counted() -> list[tuple[int, int]] | None:
        # The leader answers once it committed; a follower counts its part a moment
        # later (its counters are not fenced as its results are).
        now = _counters(cluster2)
        done = all(c1 - c0 >= expected for (c0, _), (c1, _) in zip(before, now, strict=True))
        return now if done else None

    after = wait_until(counted, 10, "every rank to count the op's data collectives")
    for (c0, b0), (c1, b1) in zip(before, after, strict=True):
        assert c1 - c0 == expected  # one data collective per bucket, none per parameter
        assert b1 - b0 == expected
    grads = [cluster2.gradients(name, rank=r) for r in range(2)]
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _retained(cluster, name: str) -> int:
    total = 0
    for w in cluster.workers():
        if w.rank < 0:
            continue
        models = _stub(w.address).ListModels(worker_pb2.ListModelsRequest(), timeout=10).models
        total += sum(m.graphs_retained for m in models if m.name == name)
    return total


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_forwards_without_backward_leave_worker_memory_flat(cluster2, gen, uname) -> None:
    model = _model(gen, width=256)
    name = uname("leak")
    cluster2.load_model(name, model, example_inputs=(torch.randn(4, 6),))
    dp = cluster2.data_parallel(name)
    x = torch.randn(64, 6, generator=gen)
    pids = [w.pid for w in cluster2.workers() if w.rank >= 0]

    def run(calls: int) -> None:
        for _ in range(calls):
            out = dp(x)  # autograd on: the workers retain a graph per call
            del out
        gc.collect()
        wait_until(lambda: _retained(cluster2, name) == 0, 20, "retained graphs released")

    run(100)  # warm up allocator pools and caches
    before = [_rss_bytes(pid) for pid in pids]
    run(1000)
    after = [_rss_bytes(pid) for pid in pids]
    for pid, b, a in zip(pids, before, after, strict=True):
        assert a - b < 24 * 1024 * 1024, f"worker {pid} grew from {b} to {a} bytes"
