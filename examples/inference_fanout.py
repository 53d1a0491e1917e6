"""Remote inference fan-out: one model, a batch split across the workers.

    python examples/inference_fanout.py                      # starts its own local cluster
    python examples/inference_fanout.py --coordinator H:P    # or uses yours

Ships an MLP to every worker as a torch.export archive, then runs batches of
several sizes through ``cluster.data_parallel`` under ``torch.no_grad()``:
each batch is split along dim 0 across the workers (a batch smaller than the
cluster uses fewer workers), every worker runs its shard, and the outputs come
back in order. Each result is checked against the model run locally.
"""

from __future__ import annotations

import time

import torch
from _cluster import cluster_for, parse_args
from torch import nn


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 10)).eval()
    with cluster_for(args) as cluster:
        info = cluster.load_model("classifier", model, example_inputs=(torch.randn(8, 32),))
        print(
            f"loaded {info.name!r} ({info.parameters} parameters) on {cluster.world_size} workers"
        )
        dp = cluster.data_parallel("classifier")
        for batch in (1, cluster.world_size - 1 or 1, 7, 1000):
            x = torch.randn(batch, 32)
            started = time.perf_counter()
            with torch.no_grad():
                logits = dp(x)
            elapsed_ms = (time.perf_counter() - started) * 1e3
            used = min(batch, cluster.world_size)
            torch.testing.assert_close(logits, model(x).detach())
            print(
                f"batch {batch:5d} over {used} worker(s): logits {tuple(logits.shape)} in "
                f"{elapsed_ms:6.1f} ms, equal to local model(x) up to rounding "
                f"(assert_close); top class of row 0: {int(logits[0].argmax())}"
            )
        cluster.unload_model("classifier")
    print("every output matched the local model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
