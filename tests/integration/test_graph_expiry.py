"""A graph whose backward never comes expires after ``--graph-ttl-s``, even while
other clients' inference forwards, which hold the model's lock shared, never stop."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from helpers import connect_ready, wait_until

from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire.pytree import InlineLeaf, to_value

ZOO = "collectives_server.model_zoo"
KWARGS = {"in_features": 512, "hidden": 2048, "out_features": 512, "depth": 2, "seed": 5}
TTL_S = 3
INFERENCE_THREADS = 8


def _retained(address: str, name: str) -> int:
    """Graphs of ``name`` the worker at ``address`` retains."""
    with grpc.insecure_channel(address) as channel:
        listed = worker_pb2_grpc.WorkerStub(channel).ListModels(
            worker_pb2.ListModelsRequest(), timeout=10
        )
    return sum(m.graphs_retained for m in listed.models if m.name == name)


@pytest.mark.timeout(180)
def test_an_orphaned_graph_expires_under_unbroken_inference(local_cluster, gen, uname) -> None:
    address = local_cluster(2, "--allow-factory", ZOO, "--graph-ttl-s", str(TTL_S))
    name = uname("expiry")
    with connect_ready(address, 2) as cluster:
        cluster.load_model(name, factory=f"{ZOO}:mlp", kwargs=KWARGS)
        dp = cluster.data_parallel(name)
        dp.eval()
        rank0 = min((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)

        # A client that dies after a forward with autograd: its graph stays on rank 0.
        call_id = f"__dp/{uname('orphan')}"
        x = torch.randn(4, KWARGS["in_features"], generator=gen)
        request = worker_pb2.ForwardRequest(
            model=name,
            call_id=call_id,
            grad_enabled=True,
            mode=worker_pb2.MODEL_MODE_EVAL,
            inline_output_bytes=1 << 20,
            args=to_value(
                (x,),
                lambda t: InlineLeaf(f"{call_id}/in/0", t),
            ),
        )
        with grpc.insecure_channel(rank0.address) as channel:
            worker_pb2_grpc.WorkerStub(channel).Forward(request, timeout=30)
        assert _retained(rank0.address, name) == 1

        stop = threading.Event()
        failures: list[BaseException] = []
        inputs = torch.randn(64, KWARGS["in_features"], generator=gen)

        def infer() -> None:
            try:
                with torch.no_grad():
                    while not stop.is_set():
                        dp(inputs)
            except BaseException as exc:  # reported below
                failures.append(exc)

        threads = [threading.Thread(target=infer) for _ in range(INFERENCE_THREADS)]
        for t in threads:
            t.start()
        try:
            wait_until(
                lambda: _retained(rank0.address, name) == 0 or failures,
                TTL_S + 30,
                "the orphaned graph to expire while inference runs",
            )
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not failures, failures
        assert all(not t.is_alive() for t in threads)
        assert _retained(rank0.address, name) == 0
