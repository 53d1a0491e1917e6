"""``make gpu-check``: the GPU paths, end to end, on this machine's GPUs.

    python -m bench.gpu_check           # on the GPUs; one line and exit 0 without one
    python -m bench.gpu_check --cpu     # the same checks on CPU workers (gloo)

For a 1-rank and a 2-rank NCCL world (as many GPUs as there are, up to 2), in
order: put/get on every rank; every collective, and with 2 ranks a ring shift
(``exchange``, point to point), at 4 B, 1 MiB and 64 MiB against what torch
computes locally on the same inputs, timed beside plain ``torch.distributed``
on the same backend in the same run; sub-groups (split from the world's
communicator) carrying an all_reduce and destroyed; a forward and a
``train_step`` of an exported model with ``arange`` and a tensor constant,
against the same model run locally. With 2 GPUs, one worker on both GPUs
serving eval forwards from its kept copies of a model across publishes; a peer
killed in the middle of
a 64 MiB all_reduce: the time until the survivor serves again, then the
restarted worker rejoining and receiving the model from its peer. Prints one
table; exits 1 on any wrong result.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import collectives

from .core import MiB, Stat, local_cluster, measure

SIZES = (4, MiB, 64 * MiB)
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "ring_shift")


def ops_for(world: int) -> tuple[str, ...]:
    """The ops a world of ``world`` ranks runs (a ring shift needs two)."""
    return OPS if world > 1 else OPS[:-1]


REPEATS = 10
TIMEOUT_S = 120.0


class ArangeModel(nn.Module):
    """Exports with a factory op (``arange``) and a lifted tensor constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.shift = torch.linspace(-1.0, 1.0, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + torch.arange(8, dtype=x.dtype)) + self.shift


def numel(nbytes: int, world: int) -> int:
    """Float32 elements for about ``nbytes``, divisible by world² (reduce_scatter and
    all_to_all split dim 0 in ``world`` parts)."""
    unit = world * world
    return max(unit, nbytes // 4 // unit * unit)


def expected(op: str, parts: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What ``rank`` holds after ``op`` over ``parts`` (rank r's input is parts[r])."""
    world = len(parts)
    if op == "all_reduce":
        return sum(parts[1:], parts[0])
    if op == "broadcast":
        return parts[0]
    if op == "all_gather":
        return torch.stack(parts)
    if op == "reduce_scatter":
        return sum(parts[1:], parts[0]).chunk(world)[rank]
    if op == "ring_shift":
        return parts[(rank - 1) % world]
    return torch.cat([p.chunk(world)[rank] for p in parts])  # all_to_all


def run_op(cluster: collectives.Cluster, op: str, name: str) -> None:
    out = None if op == "broadcast" else f"{name}/out"
    kwargs = {"timeout": TIMEOUT_S}
    if op == "broadcast":
        cluster.broadcast(name, src=0, **kwargs)
    elif op == "ring_shift":  # exchange: every rank sends right, as batch_isend_irecv
        world = cluster.world_size
        cluster.exchange(name, [(r, (r + 1) % world) for r in range(world)], out=out, **kwargs)
    else:
        getattr(cluster, op)(name, out=out, **kwargs)


def check_collectives(cluster: collectives.Cluster, world: int, failures: list[str]) -> dict:
    """Service timings per (op, bytes); every result checked against torch."""
    gen = torch.Generator().manual_seed(world)
    timings = {}
    for op in ops_for(world):
        for nbytes in SIZES:
            parts = [torch.randn(numel(nbytes, world), generator=gen) for _ in range(world)]
            name = f"gpucheck/{op}/{nbytes}"
            for rank, part in enumerate(parts):
                cluster.put(name, part, rank=rank, timeout=TIMEOUT_S)
            run_op(cluster, op, name)
            target = name if op == "broadcast" else f"{name}/out"
            for rank in range(world):
                got = cluster.get(target, rank=rank, timeout=TIMEOUT_S)
                if not torch.allclose(got, expected(op, parts, rank), rtol=1e-5, atol=1e-5):
                    failures.append(f"{op} of {nbytes} B on {world} rank(s): rank {rank} differs")
            timings[op, nbytes] = measure(functools.partial(run_op, cluster, op, name), REPEATS)
            cluster.delete(name, missing_ok=True)
            cluster.delete(target, missing_ok=True)
    return timings


def check_sub_groups(cluster: collectives.Cluster, world: int, failures: list[str]) -> None:
    """Sub-groups (split from the world's communicator on NCCL, a rank outside taking
    part): each carries an all_reduce checked against torch, then is destroyed."""
    gen = torch.Generator().manual_seed(100 + world)
    for ranks in sorted({(world - 1,), tuple(range(world))}):
        group = cluster.new_group(list(ranks), timeout=TIMEOUT_S)
        parts = {r: torch.randn(numel(MiB, world), generator=gen) for r in ranks}
        for rank, part in parts.items():
            cluster.put("gpucheck/sub", part, rank=rank, timeout=TIMEOUT_S)
        cluster.all_reduce("gpucheck/sub", out="gpucheck/sub/out", group=group, timeout=TIMEOUT_S)
        want = sum(parts.values(), torch.zeros_like(parts[ranks[0]]))
        for rank in ranks:
            got = cluster.get("gpucheck/sub/out", rank=rank, timeout=TIMEOUT_S)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                failures.append(f"all_reduce on sub-group {list(ranks)}: rank {rank} differs")
        cluster.destroy_group(group, timeout=TIMEOUT_S)
        for name in ("gpucheck/sub", "gpucheck/sub/out"):
            cluster.delete(name, missing_ok=True)


def _direct_rank(rank: int, world: int, port: int, backend: str, results) -> None:
    """Plain torch.distributed on ``backend``: the anchor, timed like the service."""
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=TIMEOUT_S))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    out = {}
    right, left = (rank + 1) % world, (rank - 1) % world
    for op in ops_for(world):
        for nbytes in SIZES:
            t = torch.randn(numel(nbytes, world), device=device)
            gathered = torch.empty(world * t.numel(), device=device)

            def step(op: str = op, t: torch.Tensor = t, gathered: torch.Tensor = gathered) -> None:
                if op == "all_reduce":
                    dist.all_reduce(t)
                elif op == "broadcast":
                    dist.broadcast(t, 0)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(gathered, t)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(t[: t.numel() // world], t)
                elif op == "ring_shift":
                    into = torch.empty_like(t)
                    shift = [dist.P2POp(dist.isend, t, right), dist.P2POp(dist.irecv, into, left)]
                    for work in dist.batch_isend_irecv(shift):
                        work.wait()
                else:
                    dist.all_to_all_single(torch.empty_like(t), t)
                if backend == "nccl":
                    torch.cuda.synchronize()

            try:
                out[op, nbytes] = measure(step, REPEATS)
            except RuntimeError as exc:  # an op this backend lacks: no anchor for it
                print(f"gpu-check: plain {backend} {op}: {str(exc).splitlines()[0]}")
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def direct_timings(world: int, backend: str) -> dict:
    from .direct_gloo import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_direct_rank, args=(r, world, port, backend, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = results.get(timeout=600)
    for p in procs:
        p.join(TIMEOUT_S)
    return got


def check_model(cluster: collectives.Cluster, world: int, failures: list[str]) -> None:
    """A forward and a train_step of an exported model with arange and a constant."""
    torch.manual_seed(7)
    model = ArangeModel()
    x = torch.randn(4 * world, 8)
    cluster.load_model("gpucheck/model", model, example_inputs=(x[:2],), timeout=TIMEOUT_S)
    dp = cluster.data_parallel("gpucheck/model", timeout=TIMEOUT_S)
    with torch.no_grad():
        if not torch.allclose(dp(x), model(x), rtol=1e-4, atol=1e-5):
            failures.append(f"forward of the exported model on {world} rank(s) differs from torch")
    # The gradient of an input on the client's device comes back on that device.
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    remote_x = x.detach().clone().to(device).requires_grad_()
    dp(remote_x).sum().backward()
    local_x = x.detach().clone().requires_grad_()
    model(local_x).sum().backward()
    grad = remote_x.grad
    if grad is None or grad.device != device or not torch.allclose(grad.cpu(), local_x.grad):
        failures.append(f"the input gradient on {world} rank(s) is wrong or off {device}")
    cluster.zero_grad("gpucheck/model", timeout=TIMEOUT_S)
    y = torch.randn(4 * world, 4)
    for rank, (xs, ys) in enumerate(zip(x.chunk(world), y.chunk(world), strict=True)):
        cluster.put("gpucheck/x", xs, rank=rank)
        cluster.put("gpucheck/y", ys, rank=rank)
    loss = cluster.train_step("gpucheck/model", "gpucheck/x", "gpucheck/y", timeout=TIMEOUT_S)
    with torch.no_grad():
        want = float(nn.functional.mse_loss(model(x), y))
    if abs(float(loss) - want) > 1e-4 * max(1.0, abs(want)):
        failures.append(f"train_step loss {float(loss)} on {world} rank(s), torch says {want}")


def check_two_gpu_worker(failures: list[str]) -> None:
    """One worker on two GPUs: eval forwards run on its kept copies of the model, which
    must follow a publish of new weights (a stale copy would serve the old ones)."""
    devices = "cpu" if not torch.cuda.is_available() else "cuda:0,cuda:1"
    with (
        local_cluster(1, "--devices", devices, "--allow-model-upload") as address,
        collectives.connect(address, timeout=TIMEOUT_S) as cluster,
    ):
        torch.manual_seed(11)
        model = ArangeModel().eval()
        x = torch.randn(16, 8)
        cluster.load_model("gpucheck/model2", model, example_inputs=(x[:2],), timeout=TIMEOUT_S)
        dp = cluster.data_parallel("gpucheck/model2", timeout=TIMEOUT_S)
        for step in range(3):
            with torch.no_grad():
                for _ in range(2):  # the second forward reuses the copies
                    if not torch.allclose(dp(x), model(x), rtol=1e-4, atol=1e-5):
                        failures.append(f"two-GPU worker: forward after {step} publish(es) differs")
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
            cluster.publish("gpucheck/model2", model.state_dict(), timeout=TIMEOUT_S)


def check_kill_and_rejoin(address: str, failures: list[str]) -> dict:
    """Rank 1 killed inside a 64 MiB all_reduce: the survivor's recovery, the rejoin."""
    with collectives.connect(address, timeout=TIMEOUT_S) as cluster:
        check_model(cluster, 2, failures)
        big = torch.randn(16 * MiB)
        for rank in range(2):
            cluster.put("gpucheck/big", big, rank=rank)
        generation = cluster.generation
        victim = next(w for w in cluster.workers() if w.rank == 1)
        work = cluster.all_reduce("gpucheck/big", async_op=True, timeout=TIMEOUT_S)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        # Failing cleanly is right; so is a success that completed before the kill.
        with contextlib.suppress(collectives.CollectiveError):
            work.result(timeout=TIMEOUT_S)
        while True:  # the survivor serves again: a new generation, an op that succeeds
            try:
                if cluster.refresh().generation > generation:
                    cluster.barrier(timeout=10)
                    break
            except collectives.CollectiveError:
                pass
            if time.monotonic() - killed > TIMEOUT_S:
                failures.append("the survivor did not serve again within 120 s")
                return {}
        recovered = time.monotonic() - killed
        deadline = time.monotonic() + TIMEOUT_S  # the launcher restarts the killed worker
        poll = threading.Event()  # never set: a bounded wait between looks
        while not ((snap := cluster.refresh()).ready and snap.world_size == 2):
            if time.monotonic() > deadline:
                failures.append("the restarted worker did not rejoin within 120 s")
                return {"recovered_s": recovered}
            poll.wait(0.2)
        rejoined = time.monotonic() - killed
        x = torch.randn(8, 8)
        dp = cluster.data_parallel("gpucheck/model", timeout=TIMEOUT_S)
        with torch.no_grad():
            local = cluster.state_dict("gpucheck/model", rank=0)
            reference = ArangeModel()
            reference.load_state_dict(local, strict=False)
            if not torch.allclose(dp(x), reference(x), rtol=1e-4, atol=1e-5):
                failures.append("the rejoined worker serves a different model than its peer")
        return {"recovered_s": recovered, "rejoined_s": rejoined}


def table(rows: list[tuple[str, Stat, Stat | None]]) -> str:
    lines = ["| what | service | plain torch.distributed | ratio |", "|---|---|---|---|"]
    for what, service, anchor in rows:
        ratio = f"{service.median / anchor.median:.2f}x" if anchor else "-"
        lines.append(
            f"| {what} | {service.text()} | {anchor.text() if anchor else '-'} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check")
    parser.add_argument("--cpu", action="store_true", help="the same checks on CPU workers")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(
            f"gpu-check: torch {torch.__version__} sees no CUDA GPU on this machine "
            f"(torch.version.cuda={torch.version.cuda}); nothing to check"
        )
        return 0
    gpus = 2 if args.cpu else min(2, torch.cuda.device_count())
    backend = "gloo" if args.cpu else "nccl"
    failures: list[str] = []
    rows: list[tuple[str, Stat, Stat | None]] = []
    for world in sorted({1, gpus}):
        devices = "cpu" if args.cpu else ",".join(f"cuda:{i}" for i in range(world))
        flags = ("--devices", devices, "--allow-model-upload")
        with (
            local_cluster(world, *flags) as address,
            collectives.connect(address, timeout=TIMEOUT_S) as cluster,
        ):
            gen = torch.Generator().manual_seed(world)
            for rank in range(world):
                t = torch.randn(MiB, generator=gen)
                cluster.put("gpucheck/pg", t, rank=rank)
                if not torch.equal(cluster.get("gpucheck/pg", rank=rank), t):
                    failures.append(f"put/get on rank {rank} of {world} returned other bytes")
            service = check_collectives(cluster, world, failures)
            check_sub_groups(cluster, world, failures)
            check_model(cluster, world, failures)
        anchor = direct_timings(world, backend)
        for (op, nbytes), stat in service.items():
            size = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes} B"
            rows.append((f"{op} {size}, {world} rank(s)", stat, anchor.get((op, nbytes))))
    recovery = {}
    if gpus >= 2:
        check_two_gpu_worker(failures)
        devices = "cpu" if args.cpu else "cuda:0,cuda:1"
        flags = ("--devices", devices, "--allow-model-upload", "--min-workers", "1")
        with local_cluster(2, *flags, "--max-restarts", "1") as address:
            recovery = check_kill_and_rejoin(address, failures)
    print(table(rows))
    for what, seconds in recovery.items():
        print(f"peer killed mid all_reduce: {what} {seconds:.2f} s")
    for failure in failures:
        print(f"WRONG: {failure}")
    print(f"gpu-check: {'FAILED' if failures else 'ok'} ({backend}, {gpus} device(s))")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
