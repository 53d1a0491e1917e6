"""Train and eval mode of a model on the cluster, against torch on the same inputs.

A model with dropout loaded in train mode (as a fresh ``nn.Module`` is) runs
dropout until ``dp.eval()``; then every shard runs in eval mode, deterministic
and equal to the local ``model.eval()(x)``. In train mode batch norm normalises
each shard with its own statistics, as each replica of ``nn.DataParallel`` does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import collectives

TIMEOUT_S = 30.0


def _dropout_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.Linear(16, 3))


def test_eval_mode_is_deterministic_and_equals_the_local_eval(cluster2, uname) -> None:
    model = _dropout_model()
    x = torch.randn(8, 6)
    name = uname("drop")
    info = cluster2.load_model(name, model, (x,), timeout=TIMEOUT_S)
    try:
        assert info.training is True
        dp = cluster2.data_parallel(name, timeout=TIMEOUT_S)
        assert dp.training is True
        with torch.no_grad():
            assert not torch.equal(dp(x), dp(x))  # dropout is on in train mode
        cluster2.load_state_dict(name, model.state_dict(), timeout=TIMEOUT_S)  # fresh stats
        assert dp.eval() is dp and dp.training is False
        assert all(not m.training for m in cluster2.models() if m.name == name)
        model.eval()
        with torch.no_grad():
            first, second = dp(x), dp(x)
            expected = model(x)
        assert torch.equal(first, second)
        torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-6)
        dp.train()
        assert dp.training is True
        assert [m.training for m in cluster2.models() if m.name == name] == [True]
    finally:
        cluster2.unload_model(name, missing_ok=True)


def test_train_mode_batch_norm_uses_each_shards_statistics(cluster2, uname) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 5)
    name = uname("bn")
    cluster2.load_model(name, model, (x,), timeout=TIMEOUT_S)
    try:
        dp = cluster2.data_parallel(name, timeout=TIMEOUT_S).train()
        with torch.no_grad():
            got = dp(x)
            # What nn.DataParallel computes on two devices: each replica's batch norm
            # normalises its own chunk of the batch.
            expected = torch.cat([model.train()(part) for part in x.chunk(cluster2.world_size)])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    finally:
        cluster2.unload_model(name, missing_ok=True)


def test_what_lives_on_the_workers_is_named_clearly(cluster2, uname) -> None:
    model = _dropout_model()
    name = uname("attrs")
    cluster2.load_model(name, model, (torch.randn(4, 6),), timeout=TIMEOUT_S)
    try:
        dp = cluster2.data_parallel(name)
        for attr in ("module", "parameters", "state_dict"):
            with pytest.raises(AttributeError, match="lives on the workers"):
                getattr(dp, attr)
        with pytest.raises(collectives.NotFound):
            cluster2.data_parallel(uname("missing")).eval()
    finally:
        cluster2.unload_model(name, missing_ok=True)
