"""Two clients on one cluster: every call means the same whoever else is connected.

Each test is a defect once reproduced with a second connection: a trainer's step
ran in the mode another client had set, a one-row shard wrote NaN into batch
norm's running statistics, "avg" from a second client divided a gradient that
the first was refused, a model exported in eval mode was recorded as training
(so its forwards were never batched), and train_step optimised another loss
than the one it returned. The oracle is torch on the same fresh random inputs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from torch import nn
from torch.nn import functional

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc

TIMEOUT_S = 30.0
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture
def second3(cluster3_address: str, cluster3) -> Iterator[collectives.Cluster]:
    """A second connection to the 3-worker cluster ``cluster3`` serves."""
    with collectives.connect(cluster3_address, timeout=TIMEOUT_S) as other:
        yield other


def _bn_model(gen: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))


def _states(cluster: collectives.Cluster, name: str) -> list[dict[str, torch.Tensor]]:
    return [cluster.state_dict(name, rank=r, timeout=TIMEOUT_S) for r in range(cluster.world_size)]


def _assert_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if value.dtype.is_floating_point:
            torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=f"{key} {where}")
        else:
            assert torch.equal(got[key], value), f"{key} {where}: {got[key]} != {value}"


def _local_train_step(
    replicas: list[nn.Module], shards: list[tuple[torch.Tensor, torch.Tensor]], lr: float
) -> float:
    """What train_step computes, in torch: every replica in train mode on its shard, the
    gradient of sum(rows_r / rows * mse_r), one SGD step applied to every replica."""
    rows = sum(x.shape[0] for x, _ in shards)
    for replica in replicas:
        replica.train()
        replica.zero_grad(set_to_none=True)
    total = 0.0
    for replica, (x, y) in zip(replicas, shards, strict=True):
        if x.shape[0] == 0:
            continue
        loss = functional.mse_loss(replica(x), y)
        (loss * (x.shape[0] / rows)).backward()
        total += float(loss.detach()) * x.shape[0] / rows
    grads = {n: torch.zeros_like(p) for n, p in replicas[0].named_parameters()}
    for replica, (x, _) in zip(replicas, shards, strict=True):
        if x.shape[0]:
            for n, p in replica.named_parameters():
                grads[n] += p.grad
    with torch.no_grad():
        for replica in replicas:
            for n, p in replica.named_parameters():
                p -= lr * grads[n]
    return total


def test_a_train_step_trains_whatever_mode_another_client_set(
    cluster3, second3, gen, uname
) -> None:
    model = _bn_model(gen)
    name = uname("mode")
    cluster3.load_model(name, model, (torch.randn(4, 5),), timeout=TIMEOUT_S)
    try:
        trainer = cluster3.data_parallel(name, timeout=TIMEOUT_S)
        assert trainer.training is True  # the module was loaded in train mode
        second3.data_parallel(name, timeout=TIMEOUT_S).eval()  # the other client's choice
        assert [m.training for m in cluster3.models() if m.name == name] == [False]

        x, y = torch.randn(12, 5, generator=gen), torch.randn(12, 2, generator=gen)
        # The trainer's forward runs in its own (train) mode: batch norm on each shard.
        with torch.no_grad():
            got = trainer(x)
        replicas = [copy.deepcopy(model).train() for _ in range(cluster3.world_size)]
        with torch.no_grad():
            want = torch.cat([r(part) for r, part in zip(replicas, x.chunk(3), strict=True)])
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)

        xs, ys = uname("x"), uname("y")
        cluster3.scatter(xs, x)
        cluster3.scatter(ys, y)
        remote = cluster3.train_step(name, xs, ys, optimizer="sgd", lr=0.1, timeout=TIMEOUT_S)
        shards = list(zip(x.tensor_split(3), y.tensor_split(3), strict=True))
        local = _local_train_step(replicas, shards, lr=0.1)
        assert remote == pytest.approx(local, rel=1e-5)
        for rank, state in enumerate(_states(cluster3, name)):
            # num_batches_tracked 2: the trainer's forward and its step, both in train mode.
            _assert_state(state, replicas[rank].state_dict(), f"on rank {rank}")
        # The step leaves the recorded mode as the other client set it.
        assert [m.training for m in second3.models() if m.name == name] == [False]
    finally:
        cluster3.unload_model(name, missing_ok=True)


def test_no_shard_of_one_row_reaches_batch_norm_in_train_mode(cluster3, gen, uname) -> None:
    model = _bn_model(gen)
    name = uname("onerow")
    cluster3.load_model(name, model, (torch.randn(4, 5),), timeout=TIMEOUT_S)
    try:
        dp = cluster3.data_parallel(name, timeout=TIMEOUT_S).train()
        x = torch.randn(7, 5, generator=gen)  # torch.chunk over 3 would give 3, 3, 1
        with torch.no_grad():
            got = dp(x)
        replicas = [copy.deepcopy(model).train() for _ in range(cluster3.world_size)]
        with torch.no_grad():
            # Two workers, 4 and 3 rows: every shard of two rows or more.
            want = torch.cat([replicas[0](x[:4]), replicas[1](x[4:])])
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        states = _states(cluster3, name)
        for rank, state in enumerate(states):
            assert all(v.isfinite().all() for v in state.values()), f"rank {rank}: {state}"
            _assert_state(state, replicas[rank].state_dict(), f"on rank {rank}")

        # A one-row batch is refused as torch refuses it, and changes nothing.
        with pytest.raises(collectives.InvalidArgument, match="more than 1 value per channel"):
            dp(torch.randn(1, 5, generator=gen))
        # train_step on data placed 2, 1, 1 rows: refused on every rank, nothing changed.
        xs, ys = uname("x"), uname("y")
        cluster3.scatter(xs, torch.randn(4, 5, generator=gen))
        cluster3.scatter(ys, torch.randn(4, 2, generator=gen))
        with pytest.raises(collectives.InvalidArgument, match="more than 1 value per channel"):
            cluster3.train_step(name, xs, ys, optimizer="sgd", lr=0.1, timeout=TIMEOUT_S)
        for rank, state in enumerate(_states(cluster3, name)):
            _assert_state(state, states[rank], f"on rank {rank} after the refusals")
        # Eval mode reads the running statistics: finite everywhere.
        with torch.no_grad():
            out = cluster3.data_parallel(name, timeout=TIMEOUT_S).eval()(x)
        assert out.isfinite().all()
    finally:
        cluster3.unload_model(name, missing_ok=True)


def test_avg_is_refused_on_dp_gradients_whichever_client_asks(
    cluster3, second3, gen, uname
) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    x, y = torch.randn(9, 5, generator=gen), torch.randn(9, 2, generator=gen)
    name = uname("avg")
    cluster3.load_model(name, model, (x,), timeout=TIMEOUT_S)
    try:
        functional.mse_loss(cluster3.data_parallel(name, timeout=TIMEOUT_S)(x), y).backward()
        for client in (second3, cluster3):
            with pytest.raises(collectives.InvalidArgument, match="Use op='sum'"):
                client.all_reduce_gradients(name, op="avg", timeout=TIMEOUT_S)
        second3.all_reduce_gradients(name, op="sum", timeout=TIMEOUT_S)
        cluster3.all_reduce_gradients(name, op="avg", timeout=TIMEOUT_S)  # whole: unchanged
        functional.mse_loss(model(x), y).backward()
        for rank in range(cluster3.world_size):
            got = second3.gradients(name, rank=rank, timeout=TIMEOUT_S)
            for key, p in model.named_parameters():
                torch.testing.assert_close(got[key], p.grad, msg=f"{key} on rank {rank}")
    finally:
        cluster3.unload_model(name, missing_ok=True)


def test_a_model_exported_in_eval_mode_is_recorded_in_eval_mode_and_batches(
    cluster3, second3, gen, uname
) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    name = uname("mlp")
    info = cluster3.load_model(
        name,
        mlp,
        (torch.randn(2, 8),),
        batching=collectives.Batching(max_rows=64, max_delay_ms=1),
        timeout=TIMEOUT_S,
    )
    try:
        assert info.training is False
        dps = [c.data_parallel(name, timeout=TIMEOUT_S) for c in (cluster3, second3)]
        assert [dp.training for dp in dps] == [False, False]
        rows = [torch.randn(1, 8, generator=gen) for _ in range(12)]

        def run(k: int) -> torch.Tensor:
            with torch.no_grad():
                return dps[k % 2](rows[k])

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(run, range(len(rows))))
        with torch.no_grad():
            for out, x in zip(outs, rows, strict=True):
                torch.testing.assert_close(out, mlp(x), rtol=RTOL, atol=ATOL)
        # Every forward went through some worker's batcher: a 1-row call runs on one
        # worker (rank 0 for a client's first, which learns that the replicas are the
        # same; then wherever the load says).
        calls = rows_seen = 0
        for worker in cluster3.workers():
            if worker.rank < 0:
                continue
            with grpc.insecure_channel(worker.address) as channel:
                listed = worker_pb2_grpc.WorkerStub(channel).ListModels(
                    worker_pb2.ListModelsRequest(), timeout=TIMEOUT_S
                )
            (mine,) = [m for m in listed.models if m.name == name]
            calls += mine.batching_stats.calls
            rows_seen += mine.batching_stats.rows
        assert calls == len(rows) and rows_seen == len(rows), (calls, rows_seen)
        (after,) = [m for m in cluster3.models() if m.name == name]
        assert after.training is False
    finally:
        cluster3.unload_model(name, missing_ok=True)


@pytest.mark.parametrize("loss", ["mse", "custom"])
def test_train_step_returns_the_loss_whose_gradient_it_applies(cluster3, gen, uname, loss) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    local = copy.deepcopy(model)
    name = uname("uneven")
    cluster3.load_model(name, model, (torch.randn(4, 5),), timeout=TIMEOUT_S)
    try:
        x, y = torch.randn(100, 5, generator=gen), torch.randn(100, 2, generator=gen)
        xs, ys = uname("x"), uname("y")
        cluster3.scatter(xs, x)  # 34, 33, 33 rows
        cluster3.scatter(ys, y)
        loss_fn = functional.mse_loss if loss == "mse" else nn.SmoothL1Loss()
        opt = torch.optim.SGD(local.parameters(), lr=0.3)
        for _ in range(3):
            remote = cluster3.train_step(
                name, xs, ys, loss=loss if loss == "mse" else loss_fn, optimizer="sgd", lr=0.3
            )
            opt.zero_grad()
            full = loss_fn(local(x), y)  # the full-batch mean, as nn.DataParallel computes it
            full.backward()
            opt.step()
            assert remote == pytest.approx(float(full.detach()), rel=1e-5)
        for rank, state in enumerate(_states(cluster3, name)):
            _assert_state(state, local.state_dict(), f"on rank {rank}")
    finally:
        cluster3.unload_model(name, missing_ok=True)
