"""A rolling upgrade across one lane release loses no call.

A worker of the previous release carries fewer methods on its call lanes
(``--lane-methods`` with the first lane release's ten stands for it: the methods
added since, e.g. ``Exchange``, ``Step``, ``ZeroGrad``, go as gRPC calls to it).
The client learns each worker's lane methods by name when a lane opens, so
during the rollout (old, old) -> (old, new) -> (new, new) every call succeeds
with torch's answer, a worker is never sent a lane method it does not name, and
a new worker takes the new methods on its lanes.
"""

from __future__ import annotations

import urllib.request
from collections import Counter

import grpc
import pytest
import torch
from launcher import free_port_block
from prometheus_client.parser import text_string_to_metric_families
from torch.nn import functional

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire.frames import FIRST_LANE_METHODS
from collectives_server import model_zoo

pytestmark = pytest.mark.timeout(240)
TIMEOUT_S = 30.0
ZOO = "collectives_server.model_zoo"
PREVIOUS_RELEASE = ("--lane-methods", ",".join(FIRST_LANE_METHODS))
# Methods the previous release's lanes do not carry, which this suite calls.
ADDED = ("Exchange", "NewGroup", "DestroyGroup", "SetModelMode", "ZeroGrad")


def _lane_calls(metrics_port: int) -> Counter[str]:
    """A worker's ``collectives_call_lane_calls_total``, by method."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    calls: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "collectives_call_lane_calls_total":
                calls[sample.labels["method"]] += int(sample.value)
    return calls


def _lane_methods(address: str) -> list[str]:
    """The methods a worker's lanes carry, as it names them to a client."""
    with grpc.insecure_channel(address) as channel:
        answer = worker_pb2_grpc.WorkerStub(channel).GetDataPlane(
            worker_pb2.DataPlaneRequest(open_lane=True), timeout=10
        )
    return [m for m in answer.lane_methods if m]


def _every_kind_of_call(client: collectives.Cluster, step: int) -> None:
    """Collectives, a point-to-point send, a group, a model's modes, forward,
    backward and gradients, each checked against torch on fresh random data."""
    gen = torch.Generator().manual_seed(100 + step)
    name = f"upgrade/{step}"
    parts = [torch.randn(5, 3, generator=gen) for _ in range(client.world_size)]
    for rank, part in enumerate(parts):
        client.put(name, part, rank=rank, timeout=TIMEOUT_S)
    client.all_reduce(name, timeout=TIMEOUT_S)
    for rank in range(client.world_size):
        torch.testing.assert_close(client.get(name, rank=rank), sum(parts))

    sent = torch.randn(4, generator=gen)
    client.put(f"{name}/p2p", sent, rank=0, timeout=TIMEOUT_S)
    client.send(f"{name}/p2p", src=0, dst=1, timeout=TIMEOUT_S)
    torch.testing.assert_close(client.get(f"{name}/p2p", rank=1), sent)

    group = client.new_group([0, 1], timeout=TIMEOUT_S)
    client.broadcast(name, src=1, group=group, timeout=TIMEOUT_S)
    torch.testing.assert_close(client.get(name, rank=0), client.get(name, rank=1))
    client.destroy_group(group, timeout=TIMEOUT_S)

    kwargs = {"in_features": 3, "hidden": 6, "out_features": 2, "depth": 1, "seed": step}
    model = model_zoo.mlp(**kwargs)
    x, y = torch.randn(8, 3, generator=gen), torch.randn(8, 2, generator=gen)
    model_name = f"upgrade-model/{step}"
    client.load_model(model_name, factory=f"{ZOO}:mlp", kwargs=kwargs, timeout=TIMEOUT_S)
    dp = client.data_parallel(model_name, timeout=TIMEOUT_S)
    dp.eval()
    with torch.no_grad():
        torch.testing.assert_close(dp(x), model(x))
    dp.train()
    client.zero_grad(model_name, timeout=TIMEOUT_S)
    functional.mse_loss(dp(x), y).backward()
    client.all_reduce_gradients(model_name, timeout=TIMEOUT_S)
    functional.mse_loss(model(x), y).backward()
    for rank in range(client.world_size):
        got = client.gradients(model_name, rank=rank, timeout=TIMEOUT_S)
        for key, param in model.named_parameters():
            torch.testing.assert_close(got[key], param.grad, msg=f"{key} on rank {rank}")
    client.unload_model(model_name, timeout=TIMEOUT_S)


def test_a_rolling_upgrade_of_the_lane_methods_loses_no_call(fault_cluster) -> None:
    ports = free_port_block(4)  # a metrics port per worker, old and new
    old_ports = ports, ports + 1
    cluster = fault_cluster(
        workers=2,
        min_workers=2,
        max_workers=2,
        worker_args=("--allow-factory", ZOO),
        # No worker is killed (each leaves), and a loaded machine must not turn a
        # late heartbeat or a slow backward (it takes the cluster's op timeout) into
        # a failure: the calls' own deadlines are what this test is about.
        lease_s=30.0,
        op_timeout_s=TIMEOUT_S,
        each_worker_args=tuple(
            (*PREVIOUS_RELEASE, "--metrics-port", str(port)) for port in old_ports
        ),
    )
    client = cluster.client
    _every_kind_of_call(client, 0)  # (old, old)
    for rank, port in enumerate(old_ports):
        calls = _lane_calls(port)
        assert calls["Forward"] > 0 and calls["Backward"] > 0, calls
        assert rank > 0 or calls["AllReduce"] > 0, calls  # collectives go to the leader
    for old in cluster.members():  # what made those calls worth checking: lanes without them
        assert not set(ADDED) & set(_lane_methods(old.address)), old.address

    generation = client.generation
    old_workers = sorted(cluster.members(), key=lambda w: w.rank)
    for step, (old, port) in enumerate(
        zip(reversed(old_workers), (ports + 2, ports + 3), strict=True), 1
    ):
        # A new-release worker waits as a spare; the old one, stopped, drains onto it.
        cluster.workers.append(cluster.start_worker("--metrics-port", str(port)))
        cluster.daemon_at(old.address).stop()
        cluster.wait_ready(2, after_generation=generation, timeout_s=60)
        generation = client.generation
        _every_kind_of_call(client, step)  # (old, new), then (new, new)

    new_calls = [_lane_calls(port) for port in (ports + 2, ports + 3)]
    # Both new workers serve the added methods (SetModelMode goes to every rank).
    for calls in new_calls:
        assert calls["SetModelMode"] > 0, calls
    # Stopping a member (SIGTERM) drains it onto the waiting spare, which takes its
    # rank: the second new worker took rank 0 when the old leader was stopped.
    new_workers = cluster.workers[-2:]
    leader = client.workers()[0].address
    assert [d.address for d in new_workers].index(leader) == 1, (leader, new_workers)
    leader_calls = new_calls[1]
    # The leader's: the sequenced ones (ZeroGrad too: one op of its order).
    assert leader_calls["Exchange"] > 0 and leader_calls["NewGroup"] > 0, leader_calls
    assert leader_calls["ZeroGrad"] > 0, leader_calls
