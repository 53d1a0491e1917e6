"""Training with the model on the cluster: remote autograd and gradient aggregation.

    python examples/train_remote.py                      # starts its own local cluster
    python examples/train_remote.py --coordinator H:P    # or uses yours

Three ways to train, each checked against the same training done locally:

1. Client-driven (``DataParallel`` semantics): the forward runs on the workers,
   the loss on the client; ``loss.backward()`` sends each worker its slice of
   the gradient, ``all_reduce_gradients`` sums them in buckets, ``step``
   updates every replica the same way.
2. Worker-side (DDP semantics): the data lives on the workers (placed once with
   ``scatter``); ``train_step`` computes each shard's loss, averages the
   gradients across workers and steps, returning the global loss.
3. Worker-side with your own loss: a function exported with ``torch.export``
   and run on the workers (no pickle), with gradient clipping (``max_grad_norm``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F  # noqa: N812
from _cluster import cluster_for, parse_args
from torch import nn


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(240, 8)
    y = (x[:, :1] * 2 - x[:, 1:2]).sin()
    with cluster_for(args) as cluster:
        # 1. Client-driven.
        local = copy.deepcopy(model)
        local_opt = torch.optim.SGD(local.parameters(), lr=0.2)
        cluster.load_model("regressor", model, example_inputs=(x[:4],))
        dp = cluster.data_parallel("regressor")
        for step in range(1, 21):
            cluster.zero_grad("regressor")
            loss = F.mse_loss(dp(x), y)
            loss.backward()
            cluster.all_reduce_gradients("regressor", op="sum")
            cluster.step("regressor", optimizer="sgd", lr=0.2)
            local_opt.zero_grad()
            F.mse_loss(local(x), y).backward()
            local_opt.step()
            if step % 5 == 0:
                print(f"client-driven step {step:2d}: loss {loss.item():.5f}")
        remote = cluster.state_dict("regressor", rank=cluster.world_size - 1)
        for key, value in local.state_dict().items():
            torch.testing.assert_close(remote[key], value, rtol=1e-4, atol=1e-6)
        print("client-driven: every replica equals the same training done locally")

        # 2. Worker-side, on data placed once.
        local = copy.deepcopy(model)
        local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
        cluster.load_model("regressor", model, example_inputs=(x[:4],))  # fresh weights
        cluster.scatter("train/x", x)
        cluster.scatter("train/y", y)
        for step in range(1, 21):
            loss = cluster.train_step(
                "regressor", "train/x", "train/y", loss="mse", optimizer="adam", lr=0.01
            )
            local_opt.zero_grad()
            F.mse_loss(local(x), y).backward()
            local_opt.step()
            if step % 5 == 0:
                print(f"train_step {step:2d}: global loss {loss:.5f}")
        remote = cluster.state_dict("regressor", rank=0)
        for key, value in local.state_dict().items():
            torch.testing.assert_close(remote[key], value, rtol=1e-4, atol=1e-5)
        print("train_step: replicas equal local full-batch training with the averaged loss")

        # 3. Your own loss, exported and run on the workers, with gradient clipping.
        def huber(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.huber_loss(output, target, delta=0.25)

        local = copy.deepcopy(model)
        local_opt = torch.optim.SGD(local.parameters(), lr=0.3)
        cluster.load_model("regressor", model, example_inputs=(x[:4],))  # fresh weights again
        for step in range(1, 11):
            loss = cluster.train_step(
                "regressor", "train/x", "train/y", loss=huber, optimizer="sgd", lr=0.3,
                max_grad_norm=0.5,
            )  # fmt: skip
            local_opt.zero_grad()
            huber(local(x), y).backward()
            torch.nn.utils.clip_grad_norm_(local.parameters(), 0.5)
            local_opt.step()
            if step % 5 == 0:
                print(f"train_step with a custom loss {step:2d}: global loss {loss:.5f}")
        remote = cluster.state_dict("regressor", rank=0)
        for key, value in local.state_dict().items():
            torch.testing.assert_close(remote[key], value, rtol=1e-4, atol=1e-5)
        print("custom loss: replicas equal local training with the same loss and clipping")
        cluster.delete("train/x")
        cluster.delete("train/y")
        cluster.unload_model("regressor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
