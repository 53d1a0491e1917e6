"""``grpc.health.v1`` on a real server built by ``rpc.start_server``.

The library's servicer sent watcher updates while holding its lock; a watcher
cancelled just before ``stop`` made ``enter_graceful_shutdown`` and the server's
event thread wait on each other for ever (a CI run hung 120 s in
``ServerHandle.stop``). With the library servicer the first round below hangs.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collectives_server.rpc import server as rpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def _noop(_server: grpc.Server) -> None:
    return None


def _watch(stub, service: str = "", n: int = 1):
    return [
        stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=30) for _ in range(n)
    ]


def _stop_within(handle: rpc.ServerHandle, deadline_s: float) -> bool:
    stopper = threading.Thread(target=handle.stop, args=(0.2,), daemon=True)
    stopper.start()
    stopper.join(deadline_s)
    return not stopper.is_alive()


@pytest.mark.parametrize("rounds", [12])
def test_stop_right_after_watchers_are_cancelled_returns(rounds: int) -> None:
    for attempt in range(rounds):
        handle = rpc.start_server("127.0.0.1", 0, [_noop], ["t.Test"], max_workers=2)
        channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
        try:
            watches = _watch(health_pb2_grpc.HealthStub(channel), n=8)
            for watch in watches:
                assert next(watch).status == SERVING
            for watch in watches:
                watch.cancel()
            assert _stop_within(handle, 10.0), f"stop hung in round {attempt}"
        finally:
            channel.close()


def test_watchers_see_each_change_in_order_then_not_serving_on_stop() -> None:
    handle = rpc.start_server("127.0.0.1", 0, [_noop], ["t.Test"], max_workers=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        (named,) = _watch(stub, "t.Test")
        (later,) = _watch(stub, "t.Later")
        assert next(named).status == SERVING
        assert next(later).status == UNKNOWN
        handle.set_serving("t.Test", False)
        handle.set_serving("t.Test", True)
        handle.set_serving("t.Later", True)
        assert [next(named).status, next(named).status] == [NOT_SERVING, SERVING]
        assert next(later).status == SERVING
        assert _stop_within(handle, 10.0)
        assert next(named).status == NOT_SERVING
        assert next(later).status == NOT_SERVING
        # Set after shutdown: ignored, Check keeps answering NOT_SERVING until the end.
        handle.set_serving("t.Test", True)
    finally:
        channel.close()


def test_check_answers_known_services_and_not_found_for_others() -> None:
    handle = rpc.start_server("127.0.0.1", 0, [_noop], ["t.Test"], max_workers=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "t.Test"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="t.Nope"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "t.Nope" in info.value.details()
    finally:
        channel.close()
        assert _stop_within(handle, 10.0)
