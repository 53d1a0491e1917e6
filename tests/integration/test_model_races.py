"""Two clients changing one cluster's models at once: every answer each of them gets
is the one torch computes locally for the state the service says it is in.

Each test runs the race a few times with fresh random data and compares every rank
with a local torch oracle (the factory's own weights, the optimizer's own steps).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch

import collectives
from collectives_server import model_zoo

pytestmark = pytest.mark.timeout(180)

ZOO = "collectives_server.model_zoo:mlp"


def _together(*calls: Callable[[], object], lag_s: float = 0.0) -> list[object]:
    """Runs ``calls`` at once, one thread each, from one barrier (each after the first
    ``lag_s`` later: where a race's window opens); their results (an exception is the
    test's finding and is raised)."""
    start = threading.Barrier(len(calls))
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, call: Callable[[], object]) -> None:
        start.wait(30)
        if i and lag_s:
            threading.Event().wait(lag_s)  # the race's timing, not a synchronisation
        try:
            results[i] = call()
        except BaseException as exc:  # raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a call did not return"
    if errors:
        raise errors[0]
    return results


def test_factories_loaded_at_once_build_their_own_weights_on_every_rank(
    cluster3, cluster3_address, uname
) -> None:
    """A factory seeds torch's one process-wide generator to build its weights: two
    builds at once on one worker (two clients loading two models) drew from each
    other's stream, and a rank served weights of neither seed."""
    kwargs = {"in_features": 256, "hidden": 256, "out_features": 64, "depth": 4}
    names = [uname("rngA"), uname("rngB")]
    seeds = [int(s) for s in torch.randint(0, 2**20, (2,))]
    wanted = [model_zoo.mlp(**kwargs, seed=s).state_dict() for s in seeds]
    with collectives.connect(cluster3_address, timeout=60) as other:
        clients = (cluster3, other)
        for _ in range(4):
            _together(
                *(
                    lambda c=c, n=n, s=s: c.load_model(n, factory=ZOO, kwargs={**kwargs, "seed": s})
                    for c, n, s in zip(clients, names, seeds, strict=True)
                )
            )
            for name, want in zip(names, wanted, strict=True):
                for rank in range(cluster3.world_size):
                    got = cluster3.state_dict(name, rank=rank)
                    for key, value in want.items():
                        assert torch.equal(got[key], value), f"{name} {key} on rank {rank}"
    for name in names:
        cluster3.unload_model(name)


def _stepped(model: torch.nn.Module, grads: dict[str, torch.Tensor], steps: list[str]):
    """``model`` after the optimizer steps named in ``steps``, in that order, on
    ``grads`` (each step keeps them, as a remote step does)."""
    for key, param in model.named_parameters():
        param.grad = grads[key].clone()
    makers = {
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1.0),
        "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5),
    }
    for kind in steps:
        makers[kind]().step()
    return model.state_dict()


def test_two_clients_steps_run_in_one_order_on_every_rank(
    cluster3, cluster3_address, gen, uname
) -> None:
    """Each client's ``step`` is one op of the leader's order: two at once run in the
    same order on every rank, so the replicas stay identical (one serial order's
    weights) and each step is one version. Sent to each worker on its own, each rank
    applied them in the order they arrived there: ranks at one version held different
    weights, and a forward split over them matched no order."""
    kwargs = {"in_features": 8, "hidden": 16, "out_features": 4, "depth": 1}
    name = uname("steps")
    with collectives.connect(cluster3_address, timeout=60) as other:
        for trial in range(5):
            seed = int(torch.randint(0, 2**20, (1,), generator=gen))
            info = cluster3.load_model(name, factory=ZOO, kwargs={**kwargs, "seed": seed})
            x, y = torch.randn(12, 8, generator=gen), torch.randn(12, 4, generator=gen)
            dp = cluster3.data_parallel(name)
            torch.nn.functional.mse_loss(dp(x), y).backward()
            cluster3.all_reduce_gradients(name)
            start, grads = cluster3.state_dict(name), cluster3.gradients(name)
            _together(
                lambda: cluster3.step(name, "sgd", lr=0.1, weight_decay=1.0),
                lambda: other.step(name, "adamw", lr=0.05, weight_decay=0.5),
            )
            orders = {}
            for steps in (["sgd", "adamw"], ["adamw", "sgd"]):
                local = model_zoo.mlp(**kwargs, seed=seed)
                local.load_state_dict(start)
                orders[" then ".join(steps)] = _stepped(local, grads, steps)
            states = [cluster3.state_dict(name, rank=r) for r in range(cluster3.world_size)]
            for rank, state in enumerate(states[1:], 1):
                for key, value in states[0].items():
                    assert torch.equal(state[key], value), f"trial {trial}: {key} on rank {rank}"
            matched = [
                order
                for order, want in orders.items()
                if all(
                    torch.allclose(states[0][k], v, rtol=1e-5, atol=1e-6) for k, v in want.items()
                )
            ]
            assert matched, f"trial {trial}: the weights match no order of the two steps"
            (model,) = [m for m in cluster3.models() if m.name == name]
            assert model.version == info.version + 2
    cluster3.unload_model(name)


def test_a_step_and_a_publish_at_once_leave_every_rank_on_one_version(
    cluster3, cluster3_address, gen, uname
) -> None:
    """A publish and another client's step, each a new version: as ops of one order
    they leave every rank on the same version with the same weights, and a forward
    runs at once. A step sent to each rank on its own could land between the
    publish's staging and its commit on one rank only: the ranks' versions split for
    good and every later forward waited out its deadline for a version that never
    came."""
    kwargs = {"in_features": 8, "hidden": 16, "out_features": 4, "depth": 1}
    name = uname("steppub")
    with collectives.connect(cluster3_address, timeout=60) as other:
        for trial in range(16):
            seed = int(torch.randint(0, 2**20, (1,), generator=gen))
            info = cluster3.load_model(name, factory=ZOO, kwargs={**kwargs, "seed": seed})
            x, y = torch.randn(12, 8, generator=gen), torch.randn(12, 4, generator=gen)
            torch.nn.functional.mse_loss(cluster3.data_parallel(name)(x), y).backward()
            cluster3.all_reduce_gradients(name)
            fresh = {
                k: torch.randn(v.shape, generator=gen)
                for k, v in model_zoo.mlp(**kwargs).state_dict().items()
            }
            # The step sent as the publish stages and commits (its window, on this machine).
            _together(
                lambda fresh=fresh: cluster3.publish(name, fresh),
                lambda: other.step(name, "sgd", lr=0.1),
                lag_s=0.002 + 0.001 * trial,
            )
            versions = {m.version for m in cluster3.models() if m.name == name}
            assert versions == {info.version + 2}, f"trial {trial}: versions {versions}"
            states = [cluster3.state_dict(name, rank=r) for r in range(cluster3.world_size)]
            for rank, state in enumerate(states[1:], 1):
                for key, value in states[0].items():
                    assert torch.equal(state[key], value), f"trial {trial}: {key} on rank {rank}"
            local = model_zoo.mlp(**kwargs)
            local.load_state_dict(states[0])
            dp = other.data_parallel(name, timeout=20)
            with torch.no_grad():
                torch.testing.assert_close(dp(x), local(x), rtol=1e-5, atol=1e-6)
    cluster3.unload_model(name)


def test_gradients_reach_the_model_across_another_clients_publish(
    cluster3, cluster3_address, gen, uname
) -> None:
    """A publish acts as if it assigned the weights in place (``load_state_dict``):
    the gradients accumulated before it stay, and the backward of a forward that ran
    on the weights before it (its graph keeps them) accumulates into the model's
    gradients. The backward used to succeed with its parameter gradients left on
    weights the model no longer had, and every rank's gradients were empty."""
    kwargs = {"in_features": 6, "hidden": 12, "out_features": 3, "depth": 1}
    name = uname("bwdpub")
    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    cluster3.load_model(name, factory=ZOO, kwargs={**kwargs, "seed": seed})
    dp = cluster3.data_parallel(name)
    before = model_zoo.mlp(**kwargs, seed=seed)
    batches = [(torch.randn(9, 6, generator=gen), torch.randn(9, 3, generator=gen)) for _ in "ab"]
    (xa, ya), (xb, yb) = batches
    torch.nn.functional.mse_loss(dp(xa), ya).backward()  # accumulated before the publish
    held = torch.nn.functional.mse_loss(dp(xb), yb)  # its graph holds the weights before
    fresh = {
        k: torch.randn(v.shape, generator=gen)
        for k, v in model_zoo.mlp(**kwargs).state_dict().items()
    }
    with collectives.connect(cluster3_address, timeout=60) as other:
        other.publish(name, fresh)
    held.backward()
    cluster3.all_reduce_gradients(name)
    for x, y in batches:
        torch.nn.functional.mse_loss(before(x), y).backward()
    for rank in range(cluster3.world_size):
        got = cluster3.gradients(name, rank=rank)
        for key, param in before.named_parameters():
            torch.testing.assert_close(got[key], param.grad, rtol=1e-4, atol=1e-6)
    assert cluster3.state_dict(name)["0.weight"].equal(fresh["0.weight"])
    cluster3.unload_model(name)


def test_a_step_between_a_forward_and_its_backward_is_refused_as_torch_refuses_it(
    cluster3, cluster3_address, gen, uname
) -> None:
    """A step writes the weights in place, so the forward's saved weights are gone: torch
    refuses the backward locally ("modified by an inplace operation"). Another client's
    step in that window made the backward fail with an opaque INTERNAL; it is now a
    FailedPrecondition that says so, and a forward run again trains on."""
    kwargs = {"in_features": 4, "hidden": 8, "out_features": 3, "depth": 1}
    name = uname("stepmid")
    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    cluster3.load_model(name, factory=ZOO, kwargs={**kwargs, "seed": seed})
    dp = cluster3.data_parallel(name)
    local = model_zoo.mlp(**kwargs, seed=seed)
    x = torch.randn(6, 4, generator=gen)
    held = dp(x).sum()
    torch.testing.assert_close(held, local(x).sum(), rtol=1e-5, atol=1e-5)
    with collectives.connect(cluster3_address, timeout=60) as other:
        other.step(name, optimizer="sgd", lr=0.1)  # no gradients yet: the weights stay
        dp(x).sum().backward()
        cluster3.all_reduce_gradients(name)
        other.step(name, optimizer="sgd", lr=0.1)
    with pytest.raises(collectives.FailedPrecondition, match="changed in place"):
        held.backward()
    local(x).sum().backward()
    with torch.no_grad():
        for param in local.parameters():
            param -= 0.1 * param.grad
    again = dp(x).sum()
    torch.testing.assert_close(again, local(x).sum(), rtol=1e-5, atol=1e-5)
    cluster3.unload_model(name)


def test_a_callable_made_before_another_clients_reload_never_spreads_a_batch_norm_model(
    cluster3, cluster3_address, gen, uname
) -> None:
    """A small forward is placed by load only while its output cannot depend on the
    worker. A client's callable learned that of an MLP; another client then loads a
    batch-norm model under the same name and trains it, so each worker's running
    statistics differ. The first client's identical calls were spread over the
    workers and answered with each one's statistics; they now all give the answer a
    split gives (rank 0's replica), as a callable made afresh does."""
    name = uname("stalebn")
    cluster3.load_model(
        name,
        factory=ZOO,
        kwargs={"in_features": 8, "hidden": 16, "out_features": 4, "depth": 1, "seed": 3},
    )
    dp = cluster3.data_parallel(name)
    dp.eval()
    with torch.no_grad():
        for _ in range(3):
            dp(torch.randn(1, 8, generator=gen))

    def batch_norm_model() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)
        )

    with collectives.connect(cluster3_address, timeout=60) as other:
        other.load_model(name, batch_norm_model().eval(), example_inputs=(torch.randn(4, 8),))
        trainer = other.data_parallel(name)
        trainer.train()
        with torch.no_grad():
            for i in range(3):  # each rank's shard moves its own running statistics
                trainer(torch.randn(12, 8, generator=gen) * (1 + i) + i)
        trainer.eval()
    first = batch_norm_model().eval()
    first.load_state_dict(cluster3.state_dict(name, rank=0))
    x = torch.randn(1, 8, generator=gen)
    with torch.no_grad():
        want = first(x)
        for call in range(12):
            torch.testing.assert_close(dp(x), want, rtol=1e-5, atol=1e-6, msg=f"call {call}")
    cluster3.unload_model(name)


def _reload_with_batch_norm(
    address: str, name: str, example: torch.Tensor
) -> tuple[collectives.Cluster, torch.nn.Module]:
    """Another client's connection, after it loaded ``name`` again as a batch-norm model."""
    other = collectives.connect(address, timeout=60)
    module = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=0.9), torch.nn.Linear(4, 2)
    ).eval()
    other.load_model(name, module, example_inputs=(example,))
    return other, module


def test_a_callable_made_before_a_reload_answers_from_the_replica_a_split_uses(
    cluster3, cluster3_address, gen, uname
) -> None:
    """A callable read its model's rules (no batch norm: placed by load) before another
    client loaded the name again with batch norm and moved rank 0's statistics alone
    (a two-row train-mode call is one shard). The other workers still said their
    replicas were equal, so the old callable's one-row calls were answered by them; a
    worker now refuses a call cut for another load, and the callable reads the model
    again, as a fresh one would."""
    name = uname("staleroute")
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).eval()
    cluster3.load_model(name, plain, example_inputs=(torch.randn(3, 4, generator=gen),))
    served = cluster3.data_parallel(name).eval()
    with torch.no_grad():
        for _ in range(2):
            served(torch.randn(1, 4, generator=gen))
    other, module = _reload_with_batch_norm(
        cluster3_address, name, torch.randn(3, 4, generator=gen)
    )
    with other, torch.no_grad():
        other.data_parallel(name).train()(torch.randn(2, 4, generator=gen) * 5 + 3)
        module.load_state_dict(other.state_dict(name, rank=0))
    with torch.no_grad():
        for call in range(20):
            x = torch.randn(1, 4, generator=gen)
            torch.testing.assert_close(served(x), module(x), msg=f"call {call}")
    cluster3.unload_model(name)


def test_a_callable_made_before_a_reload_cuts_a_train_mode_batch_for_batch_norm(
    cluster3, cluster3_address, gen, uname
) -> None:
    """The old callable cut 5 rows 2/2/1 in train mode, as for a model without batch
    norm: the one-row shard was refused, but the two others had already moved their
    workers' running statistics. It now reads the model again before anything runs
    and cuts as a fresh callable does (3/2), and each worker's statistics move once,
    as torch's on that worker's shard."""
    name = uname("stalecut")
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).train()
    cluster3.load_model(name, plain, example_inputs=(torch.randn(3, 4, generator=gen),))
    trained = cluster3.data_parallel(name)
    with torch.no_grad():
        trained(torch.randn(5, 4, generator=gen))
    other, module = _reload_with_batch_norm(
        cluster3_address, name, torch.randn(3, 4, generator=gen)
    )
    with other:
        replicas = [other.state_dict(name, rank=r) for r in range(3)]
    x = torch.randn(5, 4, generator=gen)
    with torch.no_grad():
        got = trained(x)
    expected = []
    for rank, shard in enumerate(torch.chunk(x, 2)):  # 3 and 2 rows: no shard of one
        replica = copy.deepcopy(module).train()
        replica.load_state_dict(replicas[rank])
        with torch.no_grad():
            expected.append(replica(shard))
        after = cluster3.state_dict(name, rank=rank)
        torch.testing.assert_close(after["1.running_mean"], replica[1].running_mean)
    torch.testing.assert_close(got, torch.cat(expected))
    assert torch.equal(
        cluster3.state_dict(name, rank=2)["1.running_mean"], replicas[2]["1.running_mean"]
    )
    cluster3.unload_model(name)


def test_train_mode_calls_that_straddle_publishes_move_each_workers_statistics_once(
    cluster3, cluster3_address, gen, uname
) -> None:
    """A data-parallel call whose shards straddle another client's publish runs the late
    shards again at the newest version. In train mode each run moved its worker's running
    statistics, so a straddled call counted twice there. A shard run again now leaves
    the statistics as its first run left them: every worker's equal torch's over its
    own shards, one update per call."""
    name = uname("bnrerun")
    calls = 120

    def made() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.BatchNorm1d(4, momentum=0.1), torch.nn.Linear(4, 3))

    cluster3.load_model(name, made().train(), example_inputs=(torch.randn(4, 4, generator=gen),))
    inputs = [torch.randn(6, 4, generator=gen) * 2 + 1 for _ in range(calls)]
    weights = [
        {"1.weight": torch.randn(3, 4, generator=gen), "1.bias": torch.randn(3, generator=gen)}
        for _ in range(calls)
    ]
    finished = threading.Event()

    def train() -> None:
        dp = cluster3.data_parallel(name).train()
        try:
            with torch.no_grad():
                for x in inputs:
                    dp(x)
        finally:
            finished.set()

    def publish() -> int:
        with collectives.connect(cluster3_address, timeout=60) as other:
            for count, state in enumerate(weights):
                if finished.is_set():
                    return count
                other.publish(name, state, strict=False)
        return len(weights)

    _together(train, publish)
    for rank in range(3):
        local = torch.nn.BatchNorm1d(4, momentum=0.1).train()
        with torch.no_grad():
            for x in inputs:
                local(x[2 * rank : 2 * rank + 2])  # rank r's shard of each call
        held = cluster3.state_dict(name, rank=rank)
        assert int(held["0.num_batches_tracked"]) == calls, rank
        torch.testing.assert_close(held["0.running_mean"], local.running_mean, msg=f"rank {rank}")
        torch.testing.assert_close(held["0.running_var"], local.running_var, msg=f"rank {rank}")
    cluster3.unload_model(name)


def test_two_loads_of_one_name_at_once_never_train_a_mix(
    cluster3, cluster3_address, gen, uname
) -> None:
    """Two clients load the same name at once: each load reaches the workers one by
    one, so a rank may end with the other client's. A sequenced model op then either
    finds every rank on one load and equals torch's on those weights, or refuses,
    naming the race; it used to train the mix and return a loss of neither."""
    name = uname("loads")

    def made(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
        ).eval()

    seeds = [int(s) for s in torch.randint(0, 2**20, (2,), generator=gen)]
    modules = [made(s) for s in seeds]
    example = (torch.randn(4, 8, generator=gen),)
    x, y = torch.randn(12, 8, generator=gen), torch.randn(12, 4, generator=gen)
    cluster3.scatter(f"{name}/x", x)
    cluster3.scatter(f"{name}/y", y)
    refused = 0
    with collectives.connect(cluster3_address, timeout=60) as other:
        for trial in range(8):
            _together(
                lambda: cluster3.load_model(name, modules[0], example_inputs=example),
                lambda: other.load_model(name, modules[1], example_inputs=example),
            )
            try:
                loss = cluster3.train_step(name, f"{name}/x", f"{name}/y", loss="mse")
            except collectives.FailedPrecondition as exc:
                assert "load" in exc.message and "raced" in exc.message, exc.message
                refused += 1
                continue
            held = cluster3.state_dict(name, rank=0)
            (module,) = [
                m
                for m in modules
                if all(torch.equal(held[k], v) for k, v in m.state_dict().items())
            ] or [None]
            assert module is not None, f"trial {trial}: rank 0 holds neither load"
            want = torch.nn.functional.mse_loss(module(x), y).detach()
            assert loss == pytest.approx(float(want), rel=1e-5), f"trial {trial}"
    cluster3.unload_model(name)
    cluster3.delete(f"{name}/x")
    cluster3.delete(f"{name}/y")


def test_a_factory_load_builds_its_weights_while_another_client_trains_with_dropout(
    cluster3, cluster3_address, gen, uname
) -> None:
    """A factory seeds torch's one process-wide generator; a train-mode forward with
    dropout on another model of the same worker draws from it. Loads while another
    client trained used to build weights of no seed on a rank; the
    build now holds the generator alone."""
    trained = uname("dropout")
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.Dropout(0.5), torch.nn.Linear(256, 8)
    )
    kwargs = {"in_features": 256, "hidden": 256, "out_features": 64, "depth": 4}
    name = uname("seeded")
    stop = threading.Event()
    errors: list[BaseException] = []
    with collectives.connect(cluster3_address, timeout=60) as other:
        other.load_model(trained, model, example_inputs=(torch.randn(4, 64),))

        # The oracle's weights come first, and the trainer draws its inputs from a
        # generator of its own: this process's default one is a shared stream too.
        seeds = [int(s) for s in torch.randint(0, 2**20, (6,), generator=gen)]
        wanted = [model_zoo.mlp(**kwargs, seed=seed).state_dict() for seed in seeds]
        inputs = torch.Generator().manual_seed(seeds[0])

        def train() -> None:
            dp = other.data_parallel(trained)
            dp.train()
            try:
                with torch.no_grad():
                    while not stop.is_set():
                        dp(torch.randn(256, 64, generator=inputs))
            except BaseException as exc:  # the test's finding
                errors.append(exc)

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        try:
            for trial, (seed, want) in enumerate(zip(seeds, wanted, strict=True)):
                cluster3.load_model(name, factory=ZOO, kwargs={**kwargs, "seed": seed})
                for rank in range(cluster3.world_size):
                    got = cluster3.state_dict(name, rank=rank)
                    for key, value in want.items():
                        assert torch.equal(got[key], value), f"trial {trial}: {key} on {rank}"
        finally:
            stop.set()
            thread.join(60)
        assert not thread.is_alive() and errors == [], errors
        other.unload_model(trained)
    cluster3.unload_model(name)
