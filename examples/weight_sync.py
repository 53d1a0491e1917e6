"""Weight sync: a trainer publishes new weights every step while clients run inference.

    python examples/weight_sync.py                      # starts its own local cluster of 2
    python examples/weight_sync.py --coordinator H:P    # or uses yours
    python examples/weight_sync.py --publishes 200 --calls 500

The trainer fits a local MLP to a synthetic regression task with SGD and, after
every step, publishes its ``state_dict`` with ``cluster.publish``: the weights
travel once to the leader, the workers broadcast them among themselves and
switch to them on every rank at one point of the op order. Meanwhile
``--clients`` threads, each with its own ``collectives.connect``, run
``dp(x)`` under ``torch.no_grad()`` on batches of random sizes.

Every output is checked, exactly (``torch.equal``), against the local model
at the version ``dp.last_version`` reports, shard by shard with the split
``dp`` makes: an output whose shards straddled a publish (a *mixed* output)
would match no single version. Exits 1 on any mismatch, mixed output, version
going backwards or failed call.
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812
from _cluster import cluster_for, parse_args
from torch import nn
from torch.func import functional_call

import collectives
from collectives.wire.pytree import scatter_kwargs

MODEL = "weight-sync"
IN_FEATURES = 16
Weights = dict[str, torch.Tensor]


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--publishes", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--calls", type=int, default=50, help="dp(x) calls per client")
    parser.add_argument("--clients", type=int, default=4, help="inference threads")
    parser.add_argument("--lr", type=float, default=0.1, help="the trainer's SGD step size")


@dataclass
class Client:
    """What one inference thread saw: (x, output, version) per call, and when each ended."""

    calls: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    ended: list[float] = field(default_factory=list)  # perf_counter() at each return
    error: BaseException | None = None


def infer(connection: collectives.Cluster, calls: int, seed: int, world: int, into: Client) -> None:
    """``calls`` dp(x) on batches of 1 to 4 x world rows, recording what came back."""
    gen = torch.Generator().manual_seed(seed)
    dp = connection.data_parallel(MODEL)
    try:
        for _ in range(calls):
            batch = int(torch.randint(1, 4 * world + 1, (1,), generator=gen))
            x = torch.randn(batch, IN_FEATURES, generator=gen)
            started = time.perf_counter()
            with torch.no_grad():
                out = dp(x)
            into.ended.append(time.perf_counter())
            into.latencies_s.append(into.ended[-1] - started)
            into.calls.append((x, out, dp.last_version))
    except collectives.CollectiveError as err:  # reported, and fails the run
        into.error = err


def shards(model: nn.Module, weights: Weights, x: torch.Tensor, world: int) -> list[torch.Tensor]:
    """The local model at ``weights`` on each of the shards ``dp`` makes of ``x``."""
    parts, _ = scatter_kwargs((x,), {}, world)
    with torch.no_grad():
        return [functional_call(model, weights, p) for p in parts]


def verdict(
    model: nn.Module,
    versions: dict[int, Weights],
    x: torch.Tensor,
    out: torch.Tensor,
    version: int,
    world: int,
) -> str:
    """``ok`` (every shard equals the local model at ``version``), ``mixed`` (every
    shard equals some version, but no one version explains them all) or ``wrong``."""
    parts, _ = scatter_kwargs((x,), {}, world)
    sizes = [p[0].shape[0] for p in parts]
    if out.shape[0] != sum(sizes):
        return "wrong"
    got = torch.split(out, sizes)
    want = shards(model, versions[version], x, world) if version in versions else None
    if want is not None and all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
        return "ok"
    # Which versions each shard equals (every version is kept, so this is exhaustive).
    per_version = {v: shards(model, w, x, world) for v, w in versions.items()}
    matches = [
        {v for v, w in per_version.items() if torch.equal(g, w[i])} for i, g in enumerate(got)
    ]
    if all(matches) and not set.intersection(*matches):
        return "mixed"
    return "wrong"


def percentiles_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    ranked = sorted(values)

    def at(q: float) -> float:
        return ranked[min(len(ranked) - 1, int(q * len(ranked)))] * 1e3

    return f"p50 {at(0.50):7.2f} ms  p99 {at(0.99):7.2f} ms"


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], workers=2, add_arguments=add_flags)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    teacher = torch.randn(IN_FEATURES, 1) / IN_FEATURES**0.5  # the function to learn
    held_out = torch.randn(512, IN_FEATURES)

    def held_out_loss() -> float:
        with torch.no_grad():
            return F.mse_loss(model(held_out), torch.sin(held_out @ teacher)).item()

    loss_before = held_out_loss()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    failures: list[str] = []
    with cluster_for(args) as cluster:
        world = cluster.world_size
        info = cluster.load_model(MODEL, model, example_inputs=(torch.randn(4, IN_FEATURES),))
        print(
            f"loaded {MODEL!r} ({info.parameters} parameters) at version {info.version} "
            f"on {world} workers"
        )
        versions = {info.version: {k: v.detach().clone() for k, v in model.state_dict().items()}}
        clients = [Client() for _ in range(args.clients)]
        publish_s: list[float] = []
        version = info.version
        with contextlib.ExitStack() as stack:
            # One connection per client, as separate processes would have.
            threads = [
                threading.Thread(
                    target=infer,
                    args=(
                        stack.enter_context(collectives.connect(cluster.address, timeout=60)),
                        args.calls,
                        1000 + i,
                        world,
                        client,
                    ),
                )
                for i, client in enumerate(clients)
            ]
            for t in threads:
                t.start()
            stack.callback(lambda: [t.join() for t in threads])
            for _ in range(args.publishes):
                x = torch.randn(64, IN_FEATURES)
                y = torch.sin(x @ teacher) + 0.01 * torch.randn(64, 1)
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                started = time.perf_counter()
                published = cluster.publish(MODEL, weights)
                publish_s.append(time.perf_counter() - started)
                if published != version + 1:
                    failures.append(f"publish returned version {published}, not {version + 1}")
                version = published
                versions[version] = weights
            trainer_done = time.perf_counter()
        served = [m.version for m in cluster.models() if m.name == MODEL]
        if served != [version]:
            failures.append(f"models() reports version {served}, the last publish {version}")
        cluster.unload_model(MODEL)

    counts = {"ok": 0, "mixed": 0, "wrong": 0}
    seen: set[int] = set()
    for i, client in enumerate(clients):
        if client.error is not None:
            failures.append(f"client {i} failed: {client.error}")
        observed = [v for _, _, v in client.calls]
        if observed != sorted(observed):
            failures.append(f"client {i} saw the version go backwards: {observed}")
        seen.update(observed)
        for x, out, v in client.calls:
            counts[verdict(model, versions, x, out, v, world)] += 1
    checked = sum(counts.values())
    latencies = [s for c in clients for s in c.latencies_s]
    during = sum(1 for c in clients for t in c.ended if t <= trainer_done)
    print(
        f"trained:           {len(publish_s)} SGD steps, held-out MSE {loss_before:.4f} -> "
        f"{held_out_loss():.4f}"
    )
    print(f"publishes:         {len(publish_s)} (versions {info.version + 1}..{version})")
    print(
        f"versions seen:     {len(seen)} by {args.clients} clients, {during} outputs returned "
        "while the trainer was publishing"
    )
    print(
        f"outputs checked:   {checked} ({counts['ok']} equal to the local model at their version)"
    )
    print(f"mixed outputs:     {counts['mixed']}")
    print(f"wrong outputs:     {counts['wrong']}")
    print(f"publish time:      {percentiles_ms(publish_s)}")
    print(f"dp(x) latency:     {percentiles_ms(latencies)}")
    if counts["mixed"] or counts["wrong"]:
        failures.append(f"{counts['mixed']} mixed and {counts['wrong']} wrong outputs")
    if checked != args.clients * args.calls and not any(c.error for c in clients):
        failures.append(f"checked {checked} outputs, expected {args.clients * args.calls}")
    for failure in failures:
        print(f"FAILED: {failure}")
    if failures:
        return 1
    print("every output was equal to the local model at the version it reported")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
