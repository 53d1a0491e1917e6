"""In-process fakes of the coordinator and workers for the SDK's unit tests.

They speak the real ``collectives.v1`` protocol over loopback gRPC, so the SDK
is tested end to end on the wire (framing, metadata, deadlines, retries)
without torch.distributed: the "leader" runs each collective by reaching into
the other fake workers' stores directly. Failures are injected per RPC method
with :meth:`FakeCluster.fail_next`, keyed like torchft's ``EventInjector``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
import torch

import collectives
from collectives.errors import error_for_code, to_grpc_status
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from collectives.wire import codec

_OPTIONS = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def start_server(add: object, servicer: object) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=_OPTIONS)
    add(servicer, server)  # type: ignore[operator]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Serves a Cluster message that tests replace with :meth:`publish`."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.cluster = coordinator_pb2.Cluster(status="waiting for 2 more workers")
        self.get_calls = 0
        self.stopped = False
        self.watch_opened = threading.Event()

    def publish(self, cluster: coordinator_pb2.Cluster) -> None:
        with self.cond:
            cluster.version = self.cluster.version + 1
            self.cluster = cluster
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def GetCluster(self, request, context):  # noqa: N802 - gRPC method name
        with self.cond:
            self.get_calls += 1
            return coordinator_pb2.Cluster.FromString(self.cluster.SerializeToString())

    def WatchCluster(self, request, context):  # noqa: N802 - gRPC method name
        context.add_callback(self._wake)
        self.watch_opened.set()
        seen = request.after_version

        def wake_up(after: int) -> bool:
            return self.stopped or not context.is_active() or self.cluster.version > after

        while True:
            with self.cond:
                self.cond.wait_for(lambda: wake_up(seen))  # noqa: B023 - called at once
                if self.stopped or not context.is_active():
                    return
                seen = self.cluster.version
                msg = coordinator_pb2.Cluster.FromString(self.cluster.SerializeToString())
            yield msg

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


@dataclass
class FakeCluster:
    """Shared state of the fake workers: one tensor store per rank, and a request log."""

    world_size: int = 2
    generation: int = 1
    stores: list[dict[str, torch.Tensor]] = field(default_factory=list)
    requests: dict[str, list[object]] = field(default_factory=lambda: defaultdict(list))
    failures: dict[str, list[tuple[grpc.StatusCode, str | None]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    block: dict[str, threading.Event] = field(default_factory=dict)
    groups: dict[int, list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.stores = [{} for _ in range(self.world_size)]

    def fail_next(self, method: str, code: grpc.StatusCode, executed: str | None = None) -> None:
        """The next call of ``method`` fails with ``code`` (``executed="no"``: never started)."""
        self.failures[method].append((code, executed))

    def record(self, method: str, request: object, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.requests[method].append(request)
            failure = self.failures[method].pop(0) if self.failures[method] else None
        gate = self.block.get(method)
        if gate is not None:
            gate.wait(10)
        if failure is not None:
            code, executed = failure
            _abort(context, code, f"injected {code.name} for {method}", executed)


def _abort(
    context: grpc.ServicerContext, code: grpc.StatusCode, message: str, executed: str | None
) -> None:
    """Aborts as our servers do: the fields (``executed``) ride in the status details."""
    ran = None if executed is None else executed != "no"
    context.abort_with_status(to_grpc_status(error_for_code(code, message, executed=ran)))


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, fake: FakeCluster, rank: int) -> None:
        self.fake = fake
        self.rank = rank

    @property
    def store(self) -> dict[str, torch.Tensor]:
        return self.fake.stores[self.rank]

    # --- data plane (parsed with the generated classes: the wire is plain protobuf)

    def PutTensor(self, request_iterator, context):  # noqa: N802 - gRPC method name
        assembler = None
        for msg in request_iterator:
            if msg.WhichOneof("part") == "header":
                assembler = codec.TensorAssembler(msg.header)
            else:
                assembler.add(msg.chunk)
        self.fake.record("PutTensor", assembler.name, context)
        self.store[assembler.name] = assembler.finish().clone()
        return worker_pb2.PutTensorResponse(name=assembler.name)

    def GetTensor(self, request, context):  # noqa: N802 - gRPC method name
        self.fake.record("GetTensor", request, context)
        t = self.store.get(request.name)
        if t is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"tensor {request.name!r} not on rank {self.rank}"
            )
        for part in codec.encode_tensor_stream(request.name, t, chunk_bytes=1 << 20):
            yield worker_pb2.GetTensorResponse.FromString(part)

    def DeleteTensor(self, request, context):  # noqa: N802 - gRPC method name
        self.fake.record("DeleteTensor", request, context)
        deleted = self.store.pop(request.name, None) is not None
        if not deleted and not request.missing_ok:
            context.abort(grpc.StatusCode.NOT_FOUND, f"tensor {request.name!r} not found")
        return worker_pb2.DeleteTensorResponse(deleted=deleted)

    # --- collectives: the leader reaches into every store -------------------------

    def _begin(self, method: str, request, context) -> list[int]:
        if self.rank != 0:
            _abort(context, grpc.StatusCode.UNAVAILABLE, "not the leader", "no")
        self.fake.record(method, request, context)
        options = request.options
        if options.generation not in (0, self.fake.generation):
            _abort(context, grpc.StatusCode.UNAVAILABLE, "generation changed", "no")
        if options.group_id:
            return self.fake.groups[options.group_id]
        return list(range(self.fake.world_size))

    def _operand(self, name: str, ranks: list[int], context) -> list[torch.Tensor]:
        missing = [r for r in ranks if name not in self.fake.stores[r]]
        if missing:
            context.abort(grpc.StatusCode.NOT_FOUND, f"tensor {name!r} missing on {missing}")
        return [self.fake.stores[r][name] for r in ranks]

    def AllReduce(self, request, context):  # noqa: N802 - gRPC method name
        ranks = self._begin("AllReduce", request, context)
        total = torch.stack(self._operand(request.name, ranks, context)).sum(0)
        out = request.out or request.name
        for r in ranks:
            self.fake.stores[r][out] = total.clone()
        return worker_pb2.CollectiveResponse(result_name=out, result_ranks=ranks)

    def Reduce(self, request, context):  # noqa: N802 - gRPC method name
        ranks = self._begin("Reduce", request, context)
        total = torch.stack(self._operand(request.name, ranks, context)).sum(0)
        out = request.out or request.name
        self.fake.stores[request.dst][out] = total
        return worker_pb2.CollectiveResponse(result_name=out, result_ranks=[request.dst])

    def Broadcast(self, request, context):  # noqa: N802 - gRPC method name
        ranks = self._begin("Broadcast", request, context)
        (t,) = self._operand(request.name, [request.src], context)
        for r in ranks:
            self.fake.stores[r][request.name] = t.clone()
        return worker_pb2.CollectiveResponse(result_name=request.name, result_ranks=ranks)

    def AllGather(self, request, context):  # noqa: N802 - gRPC method name
        ranks = self._begin("AllGather", request, context)
        stacked = torch.stack(self._operand(request.name, ranks, context))
        out = request.out or request.name
        for r in ranks:
            self.fake.stores[r][out] = stacked.clone()
        return worker_pb2.CollectiveResponse(result_name=out, result_ranks=ranks)

    def Gather(self, request, context):  # noqa: N802 - gRPC method name
        ranks = self._begin("Gather", request, context)
        stacked = torch.stack(self._operand(request.name, ranks, context))
        out = request.out or request.name
        self.fake.stores[request.dst][out] = stacked
        return worker_pb2.CollectiveResponse(result_name=out, result_ranks=[request.dst])

    def ReduceScatter(self, request, context):  # noqa: N802 - gRPC method name
        self._begin("ReduceScatter", request, context)
        return worker_pb2.CollectiveResponse()

    def AllToAll(self, request, context):  # noqa: N802 - gRPC method name
        self._begin("AllToAll", request, context)
        return worker_pb2.CollectiveResponse()

    def Barrier(self, request, context):  # noqa: N802 - gRPC method name
        ranks = self._begin("Barrier", request, context)
        return worker_pb2.CollectiveResponse(result_ranks=ranks)

    def NewGroup(self, request, context):  # noqa: N802 - gRPC method name
        self._begin("NewGroup", request, context)
        group_id = len(self.fake.groups) + 1
        self.fake.groups[group_id] = sorted(request.ranks)
        return worker_pb2.NewGroupResponse(
            group_id=group_id, generation=self.fake.generation, ranks=sorted(request.ranks)
        )


@dataclass
class FakeDeployment:
    """A fake coordinator and ``world_size`` fake workers on loopback."""

    coordinator: FakeCoordinator
    coordinator_address: str
    fake: FakeCluster
    worker_addresses: list[str]
    servers: list[grpc.Server]

    def formed_cluster(self, generation: int | None = None) -> coordinator_pb2.Cluster:
        generation = generation or self.fake.generation
        workers = [
            coordinator_pb2.WorkerInfo(
                worker_id=f"w{r}",
                rank=r,
                address=address,
                hostname="testhost",
                pid=1000 + r,
                state=coordinator_pb2.WORKER_STATE_READY,
                devices=["cpu"],
                joined_generation=generation,
                last_heartbeat_age_s=0.25,
                backend="gloo",
                uptime_s=12.5,
                version="0.1.0",
            )
            for r, address in enumerate(self.worker_addresses)
        ]
        workers.append(
            coordinator_pb2.WorkerInfo(
                worker_id="lost1",
                rank=-1,
                address="127.0.0.1:1",
                state=coordinator_pb2.WORKER_STATE_LOST,
                devices=["cuda:0", "cuda:1"],
            )
        )
        return coordinator_pb2.Cluster(
            generation=generation,
            formed=True,
            ready=True,
            world_size=len(self.worker_addresses),
            workers=workers,
            status="formed",
            op_timeout_s=10.0,
            min_workers=len(self.worker_addresses),
            max_workers=len(self.worker_addresses),
        )

    def stop(self) -> None:
        self.coordinator.stop()
        for server in self.servers:
            server.stop(0)


def start_deployment(world_size: int = 2, formed: bool = True) -> FakeDeployment:
    coordinator = FakeCoordinator()
    coord_server, coord_address = start_server(
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server, coordinator
    )
    fake = FakeCluster(world_size=world_size)
    servers, addresses = [coord_server], []
    for rank in range(world_size):
        server, address = start_server(
            worker_pb2_grpc.add_WorkerServicer_to_server, FakeWorker(fake, rank)
        )
        servers.append(server)
        addresses.append(address)
    deployment = FakeDeployment(coordinator, coord_address, fake, addresses, servers)
    if formed:
        coordinator.publish(deployment.formed_cluster())
    return deployment


def invalid(fn, *args, match: str | None = None, **kwargs) -> collectives.InvalidArgument:
    """Calls ``fn`` and asserts it raises InvalidArgument (matching ``match``); returns it."""
    with pytest.raises(collectives.InvalidArgument, match=match) as info:
        fn(*args, **kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value
