"""Row 6: gradient aggregation and a full remote training step, world 2.

A ~10.5 M-parameter MLP (quick: ~2.4 M) is loaded on a ``shared_cluster(2)``.

* ``all_reduce_gradients`` after a data-parallel forward/backward (only the
  aggregation call is timed) | one flat all-reduce of the same number of
  gradient bytes with direct gloo (bench/direct_gloo.py), target <= 1.1.
* A full remote step driven by the client (zero_grad, ``dp(x)``, client-side
  MSE loss, remote backward, ``all_reduce_gradients()`` (a sum), SGD ``step``)
  and ``cluster.train_step`` on data already scattered to the workers | a torch
  DDP step in 2 fresh processes, same model and global batch (bench/direct_ddp.py),
  target <= 1.5.
"""

from __future__ import annotations

import torch.nn.functional as F  # noqa: N812 - the conventional name

import collectives
from bench.core import BenchContext, Row, shared_cluster, stat_of, timed
from bench.direct_ddp import LR, batch_of, ddp_threads, mlp, param_count, run_ddp

__all__ = ["run", "WIDTHS", "QUICK_WIDTHS"]

WIDTHS = (1024, 2048, 2048, 2048, 64)  # 10.6 M parameters
QUICK_WIDTHS = (512, 1024, 1024, 768, 64)  # 2.4 M parameters
BATCH = 64
WORLD = 2
MODEL = "bench_mlp"


def _service(widths: tuple[int, ...], repeats: int) -> dict[str, list[float]]:
    model = mlp(widths)
    x, y = batch_of(widths, BATCH)
    out: dict[str, list[float]] = {}
    with collectives.connect(shared_cluster(WORLD), timeout=60.0) as cluster:
        cluster.load_model(MODEL, model, example_inputs=(x[:4],))
        try:
            _measure(cluster, x, y, repeats, out)
        finally:  # the cluster is shared with other rows
            cluster.unload_model(MODEL, missing_ok=True)
            for name in ("bench_x", "bench_y"):
                cluster.delete(name, missing_ok=True)
    return out


def _measure(cluster, x, y, repeats: int, out: dict[str, list[float]]) -> None:
    dp = cluster.data_parallel(MODEL)

    def forward_backward() -> None:
        cluster.zero_grad(MODEL)
        F.mse_loss(dp(x), y).backward()

    out["grads"] = timed(
        repeats, 1, forward_backward, lambda: cluster.all_reduce_gradients(MODEL, op="sum")
    )

    def client_step() -> None:
        cluster.zero_grad(MODEL)
        F.mse_loss(dp(x), y).backward()
        cluster.all_reduce_gradients(MODEL)  # sum: the shards add up to the batch gradient
        cluster.step(MODEL, "sgd", lr=LR)

    out["step"] = timed(repeats, 1, lambda: None, client_step)

    cluster.scatter("bench_x", x)
    cluster.scatter("bench_y", y)
    out["train_step"] = timed(
        repeats,
        1,
        lambda: None,
        lambda: cluster.train_step(MODEL, "bench_x", "bench_y", loss="mse", optimizer="sgd", lr=LR),
    )


def run(ctx: BenchContext) -> list[Row]:
    widths = QUICK_WIDTHS if ctx.quick else WIDTHS
    params = param_count(widths)
    repeats = ctx.repeats
    grad_bytes = 4 * params
    # One set of processes measures both anchors (saves a torch start-up in quick mode).
    anchors = run_ddp(WORLD, widths, BATCH, repeats, flat_bytes=grad_bytes)
    flat, ddp = anchors["flat"], anchors["ddp"]
    service = _service(widths, repeats)
    ddp_name = f"torch DDP step (gloo, {WORLD} processes, {ddp_threads(WORLD)} thread(s) each)"
    model = f"{params / 1e6:.1f} M-param MLP, world {WORLD}"
    extra = {"params": params, "widths": list(widths), "batch": BATCH, "world": WORLD}
    return [
        Row(
            group="6 training",
            what=f"all_reduce_gradients, {model}",
            service=stat_of(service["grads"], "s"),
            anchor_name=f"direct gloo flat all_reduce of {grad_bytes / 2**20:.1f} MiB",
            anchor=stat_of(flat, "s"),
            target="<= 1.1",
            note="only the aggregation call is timed (after a dp forward/backward)",
            extra=extra,
        ),
        Row(
            group="6 training",
            what=f"client-driven step, {model}, batch {BATCH}",
            service=stat_of(service["step"], "s"),
            anchor_name=ddp_name,
            anchor=stat_of(ddp, "s"),
            target="<= 1.5",
            note="zero_grad + dp(x) + client MSE + backward + all_reduce_gradients(avg) + step",
            extra=extra,
        ),
        Row(
            group="6 training",
            what=f"train_step, {model}, batch {BATCH}",
            service=stat_of(service["train_step"], "s"),
            anchor_name=ddp_name,
            anchor=stat_of(ddp, "s"),
            target="<= 1.5",
            note="data already scattered to the workers; loss, backward, avg, sgd on the workers",
            extra=extra,
        ),
    ]
