"""Model weights count against the worker's store quota.

Without that, ``--max-tensor-bytes`` would bound tensors only, and any number of
models of any size could be loaded beside them. A model's parameters and buffers are
reserved in the quota while it is loaded, and given back when it is unloaded.
"""

from __future__ import annotations

import pytest
import torch
from hostile import Aftermath

import collectives

pytestmark = pytest.mark.timeout(180)

ZOO = "collectives_server.model_zoo:mlp"
QUOTA = 2 << 20


def test_model_weights_are_counted_against_the_quota(fresh_cluster, gen) -> None:
    _, client = fresh_cluster(
        2, "--max-tensor-bytes", str(QUOTA), "--allow-factory", "collectives_server.model_zoo"
    )
    aftermath = Aftermath(client).capture()
    big = {"in_features": 256, "hidden": 1024, "out_features": 8}  # ~5 MiB of float32
    with pytest.raises(collectives.ResourceExhausted, match=r"needs \d+ bytes of weights"):
        client.load_model("quota/big", factory=ZOO, kwargs=big)
    small = {"in_features": 16, "hidden": 256, "out_features": 4}  # ~0.3 MiB
    client.load_model("quota/small", factory=ZOO, kwargs=small)
    # The model's bytes are taken: a tensor that alone would fit no longer does.
    almost_all = torch.randn((QUOTA - (64 << 10)) // 4, generator=gen)
    with pytest.raises(collectives.ResourceExhausted):
        client.put("quota/t", almost_all, rank=0)
    client.unload_model("quota/small")
    client.put("quota/t", almost_all, rank=0)  # given back on unload
    assert torch.equal(client.get("quota/t", rank=0), almost_all)
    client.delete("quota/t")
    aftermath.check()
