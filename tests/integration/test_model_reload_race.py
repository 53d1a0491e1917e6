"""A model reloaded by one client while another runs ``DataParallel`` forwards on it.

``load_model`` reaches the workers one by one, not at one point of the op order, so
for a moment one worker serves the new model and another the old. Both loads start
at version 1, so the version check that keeps a forward's shards on one publish
cannot tell them apart: a forward split over both workers in that moment used to
return rows of two different models as one answer. Each shard now names the load that
computed it (``ForwardResponse.load_id``) and a call whose shards ran two loads runs
again. The oracle: the same modules run by torch here, every answer equal to one
model's whole output.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import collectives

pytestmark = pytest.mark.timeout(180)

RELOADS = 10
ACTIVATIONS = (nn.Tanh, nn.ReLU, nn.Sigmoid, nn.GELU)
MAX_CALLS = 20_000


def _models(seed: int) -> list[nn.Module]:
    """Same parameters, other graphs: what a parameter signature cannot tell apart."""
    out = []
    for i in range(RELOADS + 1):
        torch.manual_seed(seed)
        out.append(nn.Sequential(nn.Linear(8, 16), ACTIVATIONS[i % 4](), nn.Linear(16, 4)).eval())
    return out


def test_a_split_forward_never_mixes_two_loads(cluster2, cluster2_address, gen, uname) -> None:
    name = uname()
    models = _models(int(torch.randint(0, 2**31, (1,), generator=gen)))
    inputs = [torch.randn(2, 8, generator=gen) for _ in range(32)]
    with torch.no_grad():
        wanted = [[m(x) for x in inputs] for m in models]
    loaded = [copy.deepcopy(m) for m in models]  # (exported on the loader's thread)
    cluster2.load_model(name, loaded[0], example_inputs=(torch.randn(2, 8),))
    current = [0]
    lock = threading.Lock()
    stop = threading.Event()
    found: list[str] = []
    calls = [0]

    def forwards() -> None:
        with collectives.connect(cluster2_address, timeout=60) as client:
            dp = client.data_parallel(name).eval()
            while not stop.is_set() and calls[0] < MAX_CALLS:
                k = calls[0] % len(inputs)
                with lock:
                    before = current[0]
                # Two rows over two workers: split by rank, one row each (no grad: no
                # autograd state on the workers).
                with torch.no_grad():
                    got = dp(inputs[k])
                with lock:
                    after = current[0]
                # The load after `after` may have landed before its call returned.
                loads = range(before, min(after + 2, len(models)))
                if not any(torch.allclose(got, wanted[i][k], atol=1e-5) for i in loads):
                    rows = [
                        [i for i in range(len(models)) if torch.allclose(got[r], wanted[i][k][r])]
                        for r in range(2)
                    ]
                    found.append(f"call {calls[0]}: loads {before}..{after}, rows of {rows}")
                calls[0] += 1

    reader = threading.Thread(target=forwards, daemon=True)
    reader.start()
    try:
        with collectives.connect(cluster2_address, timeout=60) as loader:
            for i in range(1, len(models)):
                loader.load_model(name, loaded[i], example_inputs=(torch.randn(2, 8),))
                with lock:
                    current[0] = i
    finally:
        stop.set()
        reader.join(60)
    assert not reader.is_alive(), "the forwarding client did not stop"
    assert calls[0] > 0
    assert found == [], "\n".join(found[:10])
