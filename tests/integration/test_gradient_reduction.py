"""Which reduction after a DataParallel backward, checked against torch.

``loss = functional.mse_loss(dp(x), y); loss.backward()`` is a loss over the whole
gathered batch: each worker holds its shard's part of the gradient and the parts
add up to the full-batch gradient, which is what the local model (and
``nn.DataParallel``) computes. So ``all_reduce_gradients`` sums by default, and
``op="avg"`` — what a DDP user reaches for — is refused with the reason until
``zero_grad``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

import collectives

TIMEOUT_S = 30.0


def test_the_default_reduction_gives_the_full_batch_gradient(cluster2, uname) -> None:
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    x, y = torch.randn(6, 5), torch.randn(6, 2)
    name = uname("grads")
    cluster2.load_model(name, model, (x,), timeout=TIMEOUT_S)
    try:
        cluster2.zero_grad(name)
        dp = cluster2.data_parallel(name, timeout=TIMEOUT_S)
        functional.mse_loss(dp(x), y).backward()
        with pytest.raises(collectives.InvalidArgument, match="Use op='sum'"):
            cluster2.all_reduce_gradients(name, op="avg", timeout=TIMEOUT_S)
        cluster2.all_reduce_gradients(name, timeout=TIMEOUT_S)

        functional.mse_loss(model(x), y).backward()
        expected = {n: p.grad for n, p in model.named_parameters()}
        for rank in range(cluster2.world_size):
            got = cluster2.gradients(name, rank=rank, timeout=TIMEOUT_S)
            assert got.keys() == expected.keys()
            for key, grad in expected.items():
                torch.testing.assert_close(got[key], grad, msg=f"{key} on rank {rank}")

        cluster2.zero_grad(name)  # gradients from elsewhere now: avg is the caller's call
        cluster2.all_reduce_gradients(name, op="avg", timeout=TIMEOUT_S)
    finally:
        cluster2.unload_model(name, missing_ok=True)
