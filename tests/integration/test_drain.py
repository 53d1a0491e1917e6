"""Drains on a real local cluster: a member's rank handed to a spare with every tensor
it holds, the drained worker restarted as the next spare, a refusal without a spare,
and a shrink that lists what was lost."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import signal
import threading
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from helpers import assert_tensor, get_each, put_each, reduce_oracle, wait_until
from launcher import free_port_block
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.nn import functional

import collectives
from collectives.errors import from_rpc_error
from collectives.observe.status_tables import format_table
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives_server import model_zoo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ZOO = "collectives_server.model_zoo"

FLAGS = ("--heartbeat", "0.2", "--lease", "3", "--devices", "cpu")
# How long the tests that hold a handoff open let a drain prepare (see _drain_held_open).
HELD_PREPARE_S = "0.3"

# Every dtype a rank may hold, one tensor each, with sizes inline and over the bulk port.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8)


def _spares(cluster: collectives.Cluster) -> list[collectives.WorkerInfo]:
    return [w for w in cluster.workers() if w.state == "spare"]


def _resident(gen: torch.Generator) -> dict[str, torch.Tensor]:
    tensors = {}
    for i, dtype in enumerate(_DTYPES):
        values = torch.randn(1000 + 37 * i, generator=gen) * 50
        tensors[f"drain/t{i}"] = values.to(dtype)
    tensors["drain/large"] = torch.randn(3 * 1024 * 1024, generator=gen)  # 12 MiB: bulk
    tensors["drain/empty"] = torch.empty(0, 4)
    return tensors


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_drain_hands_the_rank_and_its_tensors_to_the_spare(fresh_cluster, gen) -> None:
    metrics_port = free_port_block(5)
    local, cluster = fresh_cluster(3, "--spares", "1", "--metrics-port", str(metrics_port), *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    (spare,) = _spares(cluster)
    world = cluster.world_size
    held = {rank: _resident(gen) for rank in range(world)}
    for rank, tensors in held.items():
        for name, t in tensors.items():
            cluster.put(name, t, rank=rank)
    summed = [torch.randn(513, generator=gen) for _ in range(world)]
    put_each(cluster, "drain/sum", summed)
    drained = cluster.workers()[1]
    before = cluster.generation

    report = cluster.drain(drained.address)

    assert isinstance(report, collectives.DrainReport)
    assert (report.worker, report.worker_id, report.rank) == (drained.address, drained.worker_id, 1)
    assert (report.successor, report.successor_id) == (spare.address, spare.worker_id)
    assert report.error == "" and report.lost == () and not report.shrink
    assert report.generation_before == before and report.generation_after == before + 1
    expected_bytes = sum(t.numel() * t.element_size() for t in held[1].values())
    expected_bytes += summed[1].numel() * 4
    assert report.tensors_moved == len(held[1]) + 1
    assert report.bytes_moved == expected_bytes
    assert report.seconds > 0 and report.models_moved == 0
    # The spare holds the rank, with every tensor, value for value.
    assert cluster.workers()[1].worker_id == spare.worker_id
    for rank, tensors in held.items():
        for name, want in tensors.items():
            assert_tensor(cluster.get(name, rank=rank), want, what=f"{name} on rank {rank}")
    # The ranks' operands are where they were placed: a collective means the same.
    cluster.all_reduce("drain/sum", timeout=60)
    for rank, got in enumerate(get_each(cluster, "drain/sum")):
        want = reduce_oracle("sum", summed)
        assert_tensor(got, want, exact=False, what=f"all_reduce on rank {rank}")
    history = cluster.history()
    assert history[-1].generation == report.generation_after and history[-1].carried_over
    listed = cluster.snapshot().drains[-1]
    assert dataclasses.replace(listed, finished_unix_time_s=0) == dataclasses.replace(
        report, finished_unix_time_s=0
    )
    assert abs(listed.finished_unix_time_s - report.finished_unix_time_s) < 1
    # The operator sees it: the status table, and the coordinator's metrics.
    shown = format_table(local.address, cluster.snapshot(), width=400)
    assert "drains: 1 completed" in shown
    assert (
        f"{drained.worker_id} (rank 1) onto {spare.worker_id}: {report.tensors_moved} tensors"
        in shown
    )
    scraped = _metrics(metrics_port)
    assert scraped[("collectives_drains_total", (("outcome", "completed"),))] == 1
    assert scraped[("collectives_drains_total", (("outcome", "failed"),))] == 0
    assert scraped[("collectives_drain_bytes_total", ())] == report.bytes_moved
    assert scraped[("collectives_drain_in_progress", ())] == 0
    # The drained worker exited 0 and its slot came back as the next spare.
    wait_until(
        lambda: [w.pid for w in _spares(cluster)] not in ([], [spare.pid]),
        60,
        "the drained worker to come back as a spare",
    )
    (again,) = _spares(cluster)
    assert again.pid != drained.pid and local.owns(again.pid)


def test_a_drain_without_a_spare_is_refused_and_a_shrink_lists_what_was_lost(
    fresh_cluster, gen
) -> None:
    _, cluster = fresh_cluster(3, *FLAGS, "--min-workers", "2")
    a, b = torch.randn(100, generator=gen), torch.randn(7, 3, generator=gen)
    cluster.put("shrink/a", a, rank=2)
    cluster.put("shrink/b", b, rank=2)
    cluster.put("shrink/kept", a, rank=0)
    generation = cluster.generation
    victim = cluster.workers()[2]

    with pytest.raises(collectives.FailedPrecondition, match="no spare is live"):
        cluster.drain(victim.worker_id)
    assert cluster.generation == generation and cluster.world_size == 3

    report = cluster.drain(victim.worker_id, shrink=True)
    assert report.shrink and report.successor == "" and report.error == ""
    assert sorted(report.lost) == ["shrink/a", "shrink/b"]
    assert cluster.world_size == 2
    assert_tensor(cluster.get("shrink/kept", rank=0), a, what="a survivor's tensor")
    inputs = [torch.randn(33, generator=gen) for _ in range(2)]
    put_each(cluster, "shrink/sum", inputs)
    cluster.all_reduce("shrink/sum", timeout=60)
    for rank, got in enumerate(get_each(cluster, "shrink/sum")):
        assert_tensor(got, reduce_oracle("sum", inputs), what=f"after the shrink, rank {rank}")


def test_bad_drains_are_refused_clearly(fresh_cluster) -> None:
    _, cluster = fresh_cluster(2, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    (spare,) = _spares(cluster)
    with pytest.raises(collectives.NotFound, match="no live worker"):
        cluster.drain("127.0.0.1:1")
    with pytest.raises(collectives.FailedPrecondition, match="not a member"):
        cluster.drain(spare.address)
    with pytest.raises(collectives.InvalidArgument):
        cluster.drain("")
    with pytest.raises(collectives.InvalidArgument):
        cluster.drain(spare.address, timeout=-1)


def test_training_goes_on_across_a_drain_as_one_model(fresh_cluster, gen) -> None:
    """Adam's moments and step counts reach the successor with the weights (and the
    drained rank's data shard with its tensors): six train_steps, a drain after the
    third, equal six local full-batch steps, and the replicas stay bit-identical."""
    _, cluster = fresh_cluster(2, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    local = copy.deepcopy(model)
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    cluster.load_model("train/m", model, example_inputs=(torch.randn(4, 6),))
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    cluster.scatter("train/x", x)
    cluster.scatter("train/y", y)
    for step in range(6):
        if step == 3:
            report = cluster.drain(cluster.workers()[1].address)
            assert report.models_moved == 1 and report.tensors_moved >= 2
        remote = cluster.train_step(
            "train/m", "train/x", "train/y", loss="mse", optimizer="adam", lr=0.01
        )
        local_opt.zero_grad()
        loss = functional.mse_loss(local(x), y)
        loss.backward()
        local_opt.step()
        assert remote == pytest.approx(float(loss.detach()), rel=1e-4)
    states = [cluster.state_dict("train/m", rank=r) for r in range(cluster.world_size)]
    for key, value in local.state_dict().items():
        torch.testing.assert_close(states[0][key], value, rtol=1e-4, atol=1e-6)
        assert torch.equal(states[0][key], states[1][key]), f"{key}: the replicas differ"


# The training client's bound (it stops once both drains have steps after them).
_MAX_STEPS = 20_000


def _assert_trained_as_torch(
    cluster: collectives.Cluster,
    name: str,
    losses: list[float],
    local: nn.Module,
    local_opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Every step's loss equals the local model's for the same step (mse on ``batch``),
    and afterwards the replicas are bit-identical and equal the local model."""
    x, y = batch
    for step, remote in enumerate(losses):
        local_opt.zero_grad()
        loss = functional.mse_loss(local(x), y)
        loss.backward()
        local_opt.step()
        assert remote == pytest.approx(float(loss.detach()), rel=1e-3, abs=1e-6), f"step {step}"
    states = [cluster.state_dict(name, rank=r) for r in range(cluster.world_size)]
    for key, value in local.state_dict().items():
        torch.testing.assert_close(states[0][key], value, rtol=1e-3, atol=1e-5)
        assert torch.equal(states[0][key], states[1][key]), f"{key}: the replicas differ"


def _drain_each_member_while(
    cluster: collectives.Cluster,
    train: Callable[[], None],
    losses: list[float],
    errors: list[BaseException],
    stop: threading.Event,
) -> None:
    """Drains each member of a 2-member cluster in turn (rank 1, then 0) while ``train``
    runs on a thread of its own, appending a loss per step (or an error, and returning):
    each drain comes after 3 steps, and the next after 3 steps past it."""
    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    wanted: list[int] = []  # the steps each drain needs the client to have taken after it
    try:
        for rank in (1, 0):
            wait_until(lambda: len(losses) >= 3 or errors, 60, "steps before the drain")
            wait_until(lambda: len(_spares(cluster)) == 1, 60, "a live spare")
            member = next(w for w in cluster.workers() if w.rank == rank)
            cluster.drain(member.worker_id, timeout=60)
            wanted.append(len(losses) + 3)
            wait_until(
                lambda: len(losses) >= wanted[-1] or errors or not thread.is_alive(),
                60,
                "steps after the drain",
            )
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive(), "the training client did not stop"
    assert errors == [], errors
    assert len(losses) >= wanted[-1], (
        f"the client stopped at its bound ({len(losses)} steps) before {wanted[-1]}"
    )


def test_steps_running_while_drains_switch_stay_one_model(fresh_cluster, gen) -> None:
    """A client trains without pause while another drains each member in turn, the
    second drain right after the first: the switch meets steps in flight, and the
    second drain's model exchange may meet the first successor still hosting the
    model it received (its only other holder). Every step returns the loss torch
    computes locally for the same step, and afterwards the replicas are bit-identical
    and equal the local model."""
    local_cluster, cluster = fresh_cluster(2, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    local = copy.deepcopy(model)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    cluster.load_model("steps/m", model, example_inputs=(torch.randn(4, 6),))
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    cluster.scatter("steps/x", x)
    cluster.scatter("steps/y", y)
    losses: list[float] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def train() -> None:
        hyper = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
        with collectives.connect(local_cluster.address, timeout=60) as trainer:
            while not stop.is_set() and len(losses) < _MAX_STEPS:
                try:
                    losses.append(trainer.train_step("steps/m", "steps/x", "steps/y", **hyper))
                except BaseException as exc:  # the test's finding
                    errors.append(exc)
                    return

    _drain_each_member_while(cluster, train, losses, errors, stop)
    _assert_trained_as_torch(cluster, "steps/m", losses, local, local_opt, (x, y))
    # Each successor built the exported model while its drain prepared, and hosted it
    # with that module at the seal (not in a background build calls wait for).
    log = local_cluster.log_path.read_text(errors="replace")
    assert log.count("drain: built models ['steps/m'] ahead") == 2, "not built ahead"
    assert log.count("hosted model 'steps/m' with the module built ahead") == 2


def test_loads_running_while_drains_switch_reach_every_rank(fresh_cluster, gen) -> None:
    """A client loads a model again and again (each load another seed) while another
    drains each member in turn: a load that reached the drained worker after its store
    closed failed ("this worker was drained ... retry"), and a rank was left on the
    previous load. Every load now succeeds, loaded again where the rank went, and
    afterwards every rank holds the last load's weights."""
    local_cluster, cluster = fresh_cluster(2, "--spares", "1", "--allow-factory", ZOO, *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    kwargs = {"in_features": 4, "hidden": 8, "out_features": 2, "depth": 1}
    seeds = [int(s) for s in torch.randint(0, 2**20, (_MAX_STEPS,), generator=gen)]
    loaded: list[float] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def load() -> None:
        with collectives.connect(local_cluster.address, timeout=60) as loader:
            for seed in seeds:
                if stop.is_set():
                    return
                try:
                    seeded = {**kwargs, "seed": seed}
                    loader.load_model("loads/m", factory=f"{ZOO}:mlp", kwargs=seeded)
                except BaseException as exc:  # the test's finding
                    errors.append(exc)
                    return
                loaded.append(float(seed))

    _drain_each_member_while(cluster, load, loaded, errors, stop)
    want = model_zoo.mlp(**kwargs, seed=int(loaded[-1])).state_dict()
    for rank in range(cluster.world_size):
        held = cluster.state_dict("loads/m", rank=rank)
        for key, value in want.items():
            torch.testing.assert_close(held[key], value, msg=f"rank {rank} {key}")


def test_unloads_running_while_drains_switch_leave_no_rank_holding_the_model(
    fresh_cluster, gen
) -> None:
    """A client loads and unloads a model again and again while another drains each
    member in turn: an unload refused by the drained worker is sent again where the rank
    went, so every call succeeds and, after the last unload, no rank holds the model."""
    local_cluster, cluster = fresh_cluster(2, "--spares", "1", "--allow-factory", ZOO, *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    kwargs = {"in_features": 4, "hidden": 8, "out_features": 2, "depth": 1}
    cycles: list[float] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def cycle() -> None:
        with collectives.connect(local_cluster.address, timeout=60) as loader:
            while not stop.is_set() and len(cycles) < _MAX_STEPS:
                try:
                    loader.load_model("unloads/m", factory=f"{ZOO}:mlp", kwargs=kwargs)
                    loader.unload_model("unloads/m")
                except BaseException as exc:  # the test's finding
                    errors.append(exc)
                    return
                cycles.append(float(len(cycles)))

    _drain_each_member_while(cluster, cycle, cycles, errors, stop)
    for rank in range(cluster.world_size):
        with pytest.raises(collectives.NotFound):
            cluster.state_dict("unloads/m", rank=rank)


def test_a_drained_ranks_running_statistics_move_with_it(fresh_cluster, gen) -> None:
    """Batch norm's running statistics are each rank's own (its shards moved them): the
    successor takes the drained rank's, not those of the lowest peer that sent it the
    model's weights, and train-mode calls after the drain move them on as torch would."""
    _, cluster = fresh_cluster(2, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.BatchNorm1d(4, momentum=0.3), nn.Linear(4, 2)).train()
    cluster.load_model("stats/m", model, example_inputs=(torch.randn(4, 4),))
    dp = cluster.data_parallel("stats/m").train()
    replicas = [copy.deepcopy(model[0]) for _ in range(2)]
    batches = [torch.randn(6, 4, generator=gen) * 3 + torch.arange(6).view(-1, 1) for _ in range(6)]

    def train(xs: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for x in xs:
                dp(x)
                for replica, shard in zip(replicas, torch.chunk(x, 2), strict=True):
                    replica(shard)  # each rank's statistics move with its own shard

    train(batches[:3])
    drained = next(w for w in cluster.workers() if w.rank == 1)
    cluster.drain(drained.worker_id, timeout=60)
    train(batches[3:])
    for rank, replica in enumerate(replicas):
        held = cluster.state_dict("stats/m", rank=rank)
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(held[f"0.{key}"], getattr(replica, key), msg=f"{rank} {key}")
    assert next(w for w in cluster.workers() if w.rank == 1).worker_id != drained.worker_id


def test_a_client_training_with_backward_goes_on_across_drains(fresh_cluster, gen) -> None:
    """A client trains as with ``nn.DataParallel`` (``dp(x)``, ``loss.backward()`` on the
    workers, ``all_reduce_gradients``, ``step``, ``zero_grad``) without pause while
    another drains each member in turn. A forward's graph stays on the worker that ran
    it, so the drained worker waits for the backward of each graph it holds before
    the switch, and the client's next forward waits for the switch: no call fails,
    and every step's loss equals the one torch computes locally."""
    local_cluster, cluster = fresh_cluster(2, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    local = copy.deepcopy(model)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    cluster.load_model("dpbwd/m", model, example_inputs=(torch.randn(4, 6),))
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    losses: list[float] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def train() -> None:
        with collectives.connect(local_cluster.address, timeout=60) as trainer:
            dp = trainer.data_parallel("dpbwd/m", timeout=60)
            while not stop.is_set() and len(losses) < _MAX_STEPS:
                try:
                    loss = functional.mse_loss(dp(x), y)
                    loss.backward()
                    trainer.all_reduce_gradients("dpbwd/m", timeout=60)
                    trainer.step("dpbwd/m", optimizer="sgd", lr=0.05, timeout=60)
                    trainer.zero_grad("dpbwd/m", timeout=60)
                except BaseException as exc:  # the test's finding
                    errors.append(exc)
                    return
                losses.append(float(loss.detach()))

    _drain_each_member_while(cluster, train, losses, errors, stop)
    _assert_trained_as_torch(cluster, "dpbwd/m", losses, local, local_opt, (x, y))


def test_a_drain_waits_for_the_backward_of_a_forward_on_the_drained_worker(
    fresh_cluster, gen
) -> None:
    """A forward's graph stays on the worker that ran it and cannot move: the drain of
    that worker waits for the backward (the current generation serving meanwhile),
    whose gradients then move with the rank. The backward succeeds, and the reduced
    gradients and the input's gradient equal torch's full-batch ones."""
    local_cluster, cluster = fresh_cluster(2, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    cluster.load_model("bwd/m", model, example_inputs=(torch.randn(2, 4),))
    dp = cluster.data_parallel("bwd/m")
    x = torch.randn(4, 4, generator=gen, requires_grad=True)
    out = dp(x)
    drained, before = cluster.workers()[1], cluster.refresh().generation
    reports: list[collectives.DrainReport] = []
    drainer = threading.Thread(
        target=lambda: reports.append(cluster.drain(drained.worker_id, timeout=60)), daemon=True
    )
    drainer.start()
    try:
        wait_until(
            lambda: (d := cluster.refresh().drain) is not None and d.preparing,
            30,
            "the drain to prepare",
        )
        log, ready = local_cluster.log_path, f"ready for generation {before + 1} (prepared ahead)"
        wait_until(
            lambda: log.read_text(errors="replace").count(ready) == 2,
            30,
            "the member and the successor to be ready",
        )
        # The graph on the drained worker holds the seal back.
        assert cluster.refresh().generation == before and cluster.snapshot().drain is not None
        out.sum().backward()
    finally:
        drainer.join(60)
    assert reports and not reports[0].error and reports[0].worker_id == drained.worker_id
    cluster.all_reduce_gradients("bwd/m")
    local = x.detach().clone().requires_grad_(True)
    model(local).sum().backward()
    torch.testing.assert_close(x.grad, local.grad)
    grads = cluster.gradients("bwd/m", rank=1)  # the successor's, now rank 1's
    for key, param in model.named_parameters():
        torch.testing.assert_close(grads[key], param.grad, rtol=1e-5, atol=1e-6)


def test_a_backward_held_past_the_drains_preparation_says_to_run_it_again(
    fresh_cluster, gen
) -> None:
    """A client that holds a forward's outputs without a backward does not stop a drain
    for longer than its preparation may take; the backward after it cannot run on the
    drained worker, and says so (not "failed to connect"); the forward and backward
    run again, and equal torch's."""
    local_cluster, cluster = fresh_cluster(
        2, "--spares", "1", "--drain-prepare-s", HELD_PREPARE_S, *FLAGS
    )
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    cluster.load_model("bwd/m", model, example_inputs=(torch.randn(2, 4),))
    dp = cluster.data_parallel("bwd/m")
    x = torch.randn(4, 4, generator=gen, requires_grad=True)
    out = dp(x)
    drained = cluster.workers()[1]
    report = cluster.drain(drained.address)
    assert not report.error
    late = [
        line
        for line in local_cluster.log_path.read_text(errors="replace").splitlines()
        if f"not prepared in {HELD_PREPARE_S} s" in line
    ]
    assert late and drained.worker_id in late[-1], late
    with pytest.raises(collectives.FailedPrecondition, match="run the forward again"):
        out.sum().backward()
    x.grad = None
    dp(x).sum().backward()
    local = x.detach().clone().requires_grad_(True)
    model(local).sum().backward()
    torch.testing.assert_close(x.grad, local.grad)


def test_a_group_made_before_a_drain_works_after_it(fresh_cluster, gen) -> None:
    """The drain carries the generation over rank for rank: the workers rebuild its
    groups under the same ids, so a client's group keeps meaning the same ranks."""
    _, cluster = fresh_cluster(3, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    group = cluster.new_group([0, 2])
    inputs = [torch.randn(129, generator=gen) for _ in range(3)]
    put_each(cluster, "grp/x", inputs)
    cluster.drain(cluster.workers()[2].address)  # a member of the group
    assert cluster.history()[-1].carried_over
    cluster.all_reduce("grp/x", group=group, timeout=60)
    got = get_each(cluster, "grp/x")
    want = reduce_oracle("sum", [inputs[0], inputs[2]])
    for rank in (0, 2):
        assert_tensor(got[rank], want, exact=False, what=f"the group's all_reduce on {rank}")
    assert_tensor(got[1], inputs[1], what="rank 1, outside the group")
    # A group made after the drain takes a new id beside the carried one.
    later = cluster.new_group([1, 2])
    assert later.id != group.id
    cluster.broadcast("grp/x", src=1, group=later, timeout=60)
    assert_tensor(cluster.get("grp/x", rank=2), inputs[1], what="the later group's broadcast")
    parts = torch.randn(6, 3, generator=gen)
    cluster.scatter("grp/s", parts, group=group)
    assert_tensor(cluster.get("grp/s", rank=2), parts[3:], what="scatter over the old group")
    cluster.destroy_group(group)


def test_a_group_destroyed_before_a_drain_keeps_its_id_for_itself(fresh_cluster, gen) -> None:
    """Group ids are never given out twice in a cluster's carried-over generations: a
    group another client destroyed before a drain stays NOT_FOUND for its holder after
    it, even once a group made after the drain exists. The next id used to be the
    highest carried one + 1, so the destroyed group's id went to the new group, and
    the stale handle ran its ops on the new group's ranks."""
    local_cluster, cluster = fresh_cluster(3, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    with collectives.connect(local_cluster.address, timeout=60) as holder:
        kept = cluster.new_group([0, 1])
        stale = holder.new_group([0, 2])
        cluster.destroy_group(stale)
        cluster.drain(next(w for w in cluster.workers() if w.rank == 1).worker_id, timeout=60)
        assert cluster.history()[-1].carried_over
        made = cluster.new_group([1, 2])
        assert made.id not in (kept.id, stale.id), (kept, stale, made)
        operands = [torch.randn(16, generator=gen) for _ in range(3)]
        put_each(cluster, "gid/x", operands)
        holder.refresh(timeout=10)
        with pytest.raises(collectives.NotFound, match=f"group {stale.id} does not exist"):
            holder.all_reduce("gid/x", group=stale, timeout=60)
        for rank, got in enumerate(get_each(cluster, "gid/x")):
            assert_tensor(got, operands[rank], what=f"rank {rank}, untouched")
        cluster.all_reduce("gid/x", group=kept, timeout=60)  # the carried one still works
        want = reduce_oracle("sum", operands[:2])
        for rank in (0, 1):
            assert_tensor(cluster.get("gid/x", rank=rank), want, exact=False, what=f"{rank}")


def test_gradients_not_yet_reduced_move_with_the_rank(fresh_cluster, gen) -> None:
    """A client's backward leaves each rank its own gradients; a drain before the
    all_reduce_gradients hands the drained rank's to its successor, so the reduction
    equals the local full-batch gradients (without them it would miss a share)."""
    _, cluster = fresh_cluster(2, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    local = copy.deepcopy(model)
    cluster.load_model("grads/m", model, example_inputs=(torch.randn(4, 6),))
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    cluster.zero_grad("grads/m")
    functional.mse_loss(cluster.data_parallel("grads/m")(x), y, reduction="sum").backward()
    before = cluster.gradients("grads/m", rank=1)
    assert before, "rank 1 computed its shard's gradients"
    cluster.drain(cluster.workers()[1].address)
    assert cluster.gradients("grads/m", rank=1).keys() == before.keys()
    cluster.all_reduce_gradients("grads/m", op="sum")
    functional.mse_loss(local(x), y, reduction="sum").backward()
    for rank in range(cluster.world_size):
        got = cluster.gradients("grads/m", rank=rank)
        for key, param in local.named_parameters():
            torch.testing.assert_close(got[key], param.grad, rtol=1e-4, atol=1e-5)


@contextlib.contextmanager
def _drain_held_open(
    cluster: collectives.Cluster, spare: collectives.WorkerInfo, drained: str
) -> Iterator[dict[str, object]]:
    """Drains ``drained`` onto ``spare`` with the spare stopped (SIGSTOP), so the
    handoff stays open for the block's body; then lets it go and waits for the drain.
    The dict yielded holds its ``report`` once the block ended. The cluster prepares
    a drain for ``HELD_PREPARE_S`` only: the stopped spare never says it is ready, so
    the drain seals when that runs out, and the body runs after the seal."""
    ended: dict[str, object] = {}
    os.kill(spare.pid, signal.SIGSTOP)
    try:
        drain = threading.Thread(
            target=lambda: ended.update(report=cluster.drain(drained, timeout=60))
        )
        drain.start()
        wait_until(
            lambda: (d := cluster.refresh().drain) is not None and not d.preparing,
            30,
            "the drain to seal its generation",
        )
        yield ended
    finally:
        os.kill(spare.pid, signal.SIGCONT)
    drain.join(90)
    assert not drain.is_alive()
    assert ended["report"].error == "", ended["report"]


def test_forwards_placed_by_load_run_on_the_other_members_while_a_rank_is_handed_over(
    fresh_cluster, gen
) -> None:
    """A forward without autograd needs no particular rank: while a drain hands rank 1
    over (held open here by stopping its successor, the spare), each dp(x) runs on the
    members that serve the model now, with the local model's answer, instead of
    waiting for the successor; once it resumes the drain completes as usual."""
    _, cluster = fresh_cluster(3, "--spares", "1", "--heartbeat", "0.2", "--lease", "8",
                               "--devices", "cpu", "--drain-prepare-s", HELD_PREPARE_S)  # fmt: skip
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    (spare,) = _spares(cluster)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).eval()
    cluster.load_model("serve/m", model, example_inputs=(torch.randn(4, 6),))
    dp = cluster.data_parallel("serve/m", timeout=10)  # no call may wait out the drain
    dp.eval()
    with torch.no_grad():
        x = torch.randn(1, 6, generator=gen)
        torch.testing.assert_close(dp(x), model(x), rtol=1e-5, atol=1e-6)
    drained = cluster.workers()[1]
    with _drain_held_open(cluster, spare, drained.address) as ended:
        with torch.no_grad():
            for rows in (1, 2, 3, 5):  # placed by load, and split over the two others
                x = torch.randn(rows, 6, generator=gen)
                torch.testing.assert_close(dp(x), model(x), rtol=1e-5, atol=1e-6)
        view = cluster.refresh()
        assert view.drain is not None, "the drain ended while its successor was stopped"
    report = ended["report"]
    assert report.successor_id == spare.worker_id, report
    with torch.no_grad():
        x = torch.randn(5, 6, generator=gen)
        torch.testing.assert_close(dp(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_forward_with_autograd_during_a_handoff_runs_after_it_never_on_the_drained_rank(
    fresh_cluster, gen
) -> None:
    """While a drain hands rank 1 over (held open by stopping the spare), the drained
    worker refuses a forward with autograd before running it (a graph made there could
    not move; UNAVAILABLE, not executed), and a client's dp(x) with autograd waits for
    the handoff, then runs on the successor: its backward succeeds and equals torch's."""
    _, cluster = fresh_cluster(2, "--spares", "1", "--heartbeat", "0.2", "--lease", "8",
                               "--devices", "cpu", "--drain-prepare-s", HELD_PREPARE_S)  # fmt: skip
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    (spare,) = _spares(cluster)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    cluster.load_model("gate/m", model, example_inputs=(torch.randn(2, 5),))
    dp = cluster.data_parallel("gate/m", timeout=60)
    x = torch.randn(6, 5, generator=gen, requires_grad=True)
    drained = cluster.workers()[1]
    outcome: list[BaseException | None] = []

    def train_once() -> None:
        try:
            dp(x).sum().backward()
            outcome.append(None)
        except BaseException as exc:  # the test's finding
            outcome.append(exc)

    with _drain_held_open(cluster, spare, drained.address):
        with grpc.insecure_channel(drained.address) as channel:
            request = worker_pb2.ForwardRequest(
                model="gate/m", call_id="__dp/refused", grad_enabled=True
            )
            with pytest.raises(grpc.RpcError) as refused:
                worker_pb2_grpc.WorkerStub(channel).Forward(request, timeout=10)
        err = from_rpc_error(refused.value)
        assert isinstance(err, collectives.Unavailable) and err.executed is False, err
        assert "drained" in err.message
        trainer = threading.Thread(target=train_once, daemon=True)
        trainer.start()
    trainer.join(60)
    assert outcome == [None], outcome
    local = x.detach().clone().requires_grad_(True)
    model(local).sum().backward()
    torch.testing.assert_close(x.grad, local.grad)
    assert drained.worker_id not in {w.worker_id for w in cluster.refresh().members}


def test_a_collective_issued_during_a_handoff_waits_at_its_leader_and_runs_after_it(
    fresh_cluster, gen
) -> None:
    """While a drain hands rank 2 over (held open by stopping its successor, the spare),
    an all_reduce is sent at once for the generation the drain sealed: its leader, a
    survivor, admits it behind that generation's gate (it shows in the leader's queue
    before any member has joined), and it runs as the handoff ends, over the operand
    the successor received, equal to torch's sum on every rank."""
    _, cluster = fresh_cluster(3, "--spares", "1", "--heartbeat", "0.2", "--lease", "8",
                               "--devices", "cpu", "--drain-prepare-s", HELD_PREPARE_S)  # fmt: skip
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    (spare,) = _spares(cluster)
    operands = [torch.randn(1000 + 7 * r, generator=gen)[:1000] for r in range(3)]
    put_each(cluster, "gate/x", operands)
    (drained,) = [w for w in cluster.workers() if w.rank == 2]
    (leader,) = [w for w in cluster.workers() if w.rank == 0]

    def leader_queue() -> int:
        return next(w.queue_depth for w in cluster.workers() if w.worker_id == leader.worker_id)

    with _drain_held_open(cluster, spare, drained.address) as ended:
        work = cluster.all_reduce("gate/x", out="gate/sum", async_op=True, timeout=60)
        wait_until(lambda: leader_queue() >= 1, 20, "the leader to admit the op behind the gate")
        assert not work.is_completed(), "the op ran before the handoff ended"
        assert not cluster.refresh().ready
    work.wait(60)
    assert work.generation == ended["report"].generation_after
    want = reduce_oracle("sum", operands)
    for rank, got in enumerate(get_each(cluster, "gate/sum")):
        assert_tensor(got, want, exact=False, what=f"the sum on rank {rank}")


def _preparing_cluster(fresh_cluster, gen, rank: int):
    """3 members and a spare, drains prepared for up to 6 s (a lease of 8 s outlasts a
    member held meanwhile), and ``rank`` holding every kind of tensor: (the launcher,
    the client, the spare, what ``rank`` holds)."""
    local, cluster = fresh_cluster(3, "--spares", "1", "--heartbeat", "0.2", "--lease", "8",
                                   "--devices", "cpu", "--drain-prepare-s", "6")  # fmt: skip
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    (spare,) = _spares(cluster)
    held = _resident(gen)
    for name, t in held.items():
        cluster.put(name, t, rank=rank)
    return local, cluster, spare, held


def test_what_changes_while_a_drain_prepares_reaches_the_successor(fresh_cluster, gen) -> None:
    """The successor copies the drained rank ahead, while the cluster still serves;
    what a client changes on that rank afterwards, before the seal (a tensor replaced,
    one deleted, one added), is what the successor holds after the drain, and what
    did not change is kept from the copy ahead. The seal is held back by stopping
    rank 0, so its groups cannot form ahead, until the changes are made."""
    local, cluster, spare, held = _preparing_cluster(fresh_cluster, gen, rank=1)
    total = sum(t.numel() * t.element_size() for t in held.values())
    drained, leader = cluster.workers()[1], cluster.workers()[0]
    replaced, deleted, added = "drain/large", "drain/t0", "drain/added"
    copied_ahead = f"copied {len(held)} tensors ({total} bytes) ahead"
    ended: dict[str, object] = {}
    os.kill(leader.pid, signal.SIGSTOP)
    try:
        drain = threading.Thread(target=lambda: ended.update(report=cluster.drain(drained.address)))
        drain.start()
        wait_until(
            lambda: (
                (d := cluster.refresh().drain) is not None
                and d.preparing
                and d.bytes_copied >= total
            ),
            30,
            "the successor's copy ahead",
        )
        held[replaced] = torch.randn(3 * 1024 * 1024, generator=gen)
        cluster.put(replaced, held[replaced], rank=1)
        cluster.delete(deleted, rank=1)
        del held[deleted]
        held[added] = torch.randn(77, generator=gen).to(torch.float64)
        cluster.put(added, held[added], rank=1)
        assert cluster.refresh().drain.preparing, "sealed before rank 0 could prepare"
    finally:
        os.kill(leader.pid, signal.SIGCONT)
    drain.join(90)
    assert not drain.is_alive()
    report = ended["report"]
    assert report.error == "" and report.successor_id == spare.worker_id, report
    assert report.tensors_moved == len(held), report
    assert report.bytes_moved == sum(t.numel() * t.element_size() for t in held.values())
    assert 0 < report.prepare_seconds < report.seconds, report
    for name, want in held.items():
        assert_tensor(cluster.get(name, rank=1), want, what=f"{name} on the successor")
    with pytest.raises(collectives.NotFound):
        cluster.get(deleted, rank=1)
    log = local.log_path.read_text(errors="replace")
    assert copied_ahead in log, "no copy ahead was taken"
    unchanged = len(held) - 2  # (the one replaced and the one added moved after the seal)
    assert f"{len(held)} tensors ({report.bytes_moved} bytes; {unchanged} kept" in log
    assert "sealed on groups formed ahead; none here" not in log


def test_members_stopped_together_drain_in_turn(fresh_cluster, gen) -> None:
    """SIGTERM to two members at once (a supervisor draining a node), with one spare:
    the first to ask drains onto the spare; the second, refused while that drain
    runs, waits for it to end and for the drained worker to come back as a spare,
    then drains onto it. Both ranks keep every tensor they held."""
    local, cluster = fresh_cluster(3, "--spares", "1", *FLAGS)
    wait_until(lambda: len(_spares(cluster)) == 1, 30, "the spare to be listed")
    held = {
        rank: {f"both/{rank}/{i}": torch.randn(257 * (i + 1), generator=gen) for i in range(3)}
        for rank in (1, 2)
    }
    for rank, tensors in held.items():
        for name, t in tensors.items():
            cluster.put(name, t, rank=rank)
    stopped = [w for w in cluster.workers() if w.rank in held]
    drains_before = len(cluster.snapshot().drains)
    for w in stopped:
        os.kill(w.pid, signal.SIGTERM)

    def both_drained() -> bool:
        members = {w.worker_id for w in cluster.refresh().members}
        ended = cluster.snapshot().drains[drains_before:]
        return len(ended) >= 2 and not members & {w.worker_id for w in stopped}

    wait_until(both_drained, 120, "both stopped members to be drained")
    reports = cluster.snapshot().drains[drains_before:]
    assert [r.error for r in reports] == ["", ""], reports
    assert {r.worker_id for r in reports} == {w.worker_id for w in stopped}
    for rank, tensors in held.items():
        for name, want in tensors.items():
            assert_tensor(cluster.get(name, rank=rank), want, what=f"{name} on rank {rank}")
    log = local.log_path.read_text(errors="replace")
    assert "this worker's comes next" in log, "no worker waited for the other's drain"


def test_a_worker_stopped_while_its_drain_prepares_waits_for_it(fresh_cluster, gen) -> None:
    """SIGTERM to a worker whose drain is still being prepared (a supervisor stopping
    it while an operator's drain runs): the worker waits for that drain, which
    completes with every tensor on the spare, instead of leaving with them. A second
    drain of the same worker asked meanwhile (a preStop hook, another operator)
    answers that same drain's report instead of a refusal."""
    local, cluster, spare, held = _preparing_cluster(fresh_cluster, gen, rank=2)
    drained, leader = cluster.workers()[2], cluster.workers()[0]
    ended: dict[str, object] = {}
    os.kill(leader.pid, signal.SIGSTOP)  # (its groups cannot form ahead: the seal waits)
    try:
        drain = threading.Thread(target=lambda: ended.update(report=cluster.drain(drained.address)))
        drain.start()
        wait_until(
            lambda: (d := cluster.refresh().drain) is not None and d.preparing,
            30,
            "the drain to prepare",
        )
        again = threading.Thread(
            target=lambda: ended.update(again=cluster.drain(drained.worker_id, timeout=60))
        )
        again.start()
        os.kill(drained.pid, signal.SIGTERM)
        assert cluster.refresh().drain.preparing
    finally:
        os.kill(leader.pid, signal.SIGCONT)
    for thread in (drain, again):
        thread.join(90)
        assert not thread.is_alive()
    report = ended["report"]
    assert report.error == "" and report.successor_id == spare.worker_id, report
    same = dataclasses.replace(ended["again"], finished_unix_time_s=report.finished_unix_time_s)
    assert same == report, "the second drain answered another drain"
    for name, want in held.items():
        assert_tensor(cluster.get(name, rank=2), want, what=f"{name} on the successor")
    # The stopped worker saw its drain and waited for it, or asked for one and got it.
    log = local.log_path.read_text(errors="replace")
    waited = "this worker is being drained already; waiting for it" in log
    assert waited or f"drained onto {spare.address}" in log, "the worker did not wait"
