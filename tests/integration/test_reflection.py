"""What ``grpcurl -plaintext`` relies on: server reflection lists the services and
resolves their descriptors, and ``grpc.health.v1`` answers SERVING, on the
coordinator and on a worker."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

RPC_TIMEOUT_S = 10.0


@pytest.fixture(params=["coordinator", "worker"])
def endpoint(request, cluster2_address, cluster2) -> tuple[str, str]:
    """(address, the collectives service it must serve)."""
    if request.param == "coordinator":
        return cluster2_address, "collectives.v1.Coordinator"
    return cluster2.workers()[1].address, "collectives.v1.Worker"


def _list_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = list(stub.ServerReflectionInfo(iter([request]), timeout=RPC_TIMEOUT_S))
    assert len(responses) == 1
    return [s.name for s in responses[0].list_services_response.service]


def test_reflection_lists_the_service_health_and_reflection(endpoint):
    address, service = endpoint
    with grpc.insecure_channel(address) as channel:
        names = _list_services(channel)
    assert service in names, f"{address} lists {names}"
    assert "grpc.health.v1.Health" in names, names
    assert "grpc.reflection.v1alpha.ServerReflection" in names, names


def test_reflection_resolves_the_service_descriptor(endpoint):
    """``grpcurl describe``: the full descriptor, methods included, comes over the wire."""
    address, service = endpoint
    with grpc.insecure_channel(address) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        desc = pool.FindServiceByName(service)
        methods = {m.name for m in desc.methods}
    expected = {"GetCluster", "WatchCluster", "Register", "Heartbeat"}
    if service.endswith("Worker"):
        expected = {"PutTensor", "GetTensor", "AllReduce", "Broadcast", "Barrier", "NewGroup"}
    assert expected <= methods, f"{service} methods: {sorted(methods)}"


def test_health_answers_serving(endpoint):
    address, service = endpoint
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        overall = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S)
        named = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
    assert overall.status == health_pb2.HealthCheckResponse.SERVING
    assert named.status == health_pb2.HealthCheckResponse.SERVING


def test_health_of_an_unknown_service_is_not_found(endpoint):
    address, _ = endpoint
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
