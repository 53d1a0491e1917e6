"""The SDK never moves its view of the cluster back to an older one.

An HA set has several coordinators; one that stood by with an old copy must not
roll a client back to an older generation, and ``connect()`` given the whole set
goes past one that refuses (UNAVAILABLE: it cannot show that its view is
current). The rule alone (:meth:`ClusterSnapshot.older_than`) is checked on
values; the SDK's use of it on the wire, against the in-process protocol fakes of
``sdk_fakes`` (the real scenario, with real coordinators on etcd, is in
``tests/fault/test_ha_coordinator.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from helpers import wait_until
from sdk_fakes import FakeCoordinator, FakeDeployment, start_deployment, start_server

import collectives
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives.wire.cluster_state import ClusterSnapshot

STALE = "GetCluster: this coordinator's view may be stale: etcd did not answer; try another"


def _snapshot(generation: int, version: int) -> ClusterSnapshot:
    return ClusterSnapshot.from_proto(
        coordinator_pb2.Cluster(generation=generation, version=version, formed=True)
    )


def test_an_earlier_generation_or_version_is_older() -> None:
    seen = _snapshot(generation=2, version=100)
    assert _snapshot(1, 100).older_than(seen)
    assert _snapshot(1, 500).older_than(seen)  # another coordinator's larger version
    assert _snapshot(2, 99).older_than(seen)
    assert not _snapshot(2, 100).older_than(seen)
    assert not _snapshot(2, 101).older_than(seen)
    assert not _snapshot(3, 101).older_than(seen)
    assert not _snapshot(3, 7).older_than(seen)  # a later generation, whatever its version


class RefusingCoordinator(FakeCoordinator):
    """A coordinator of an HA set that cannot show its view is current: it refuses reads."""

    def GetCluster(self, request, context):  # noqa: N802 - gRPC method name
        with self.cond:
            self.get_calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, STALE)

    def WatchCluster(self, request, context):  # noqa: N802 - gRPC method name
        context.abort(grpc.StatusCode.UNAVAILABLE, STALE)


@pytest.fixture
def deployment() -> Iterator[FakeDeployment]:
    d = start_deployment(world_size=2)
    d.fake.generation = 2
    d.coordinator.publish(d.formed_cluster(generation=2))
    yield d
    d.stop()


@pytest.fixture
def other() -> Iterator[tuple[FakeCoordinator, str]]:
    """A second coordinator of the set, serving whatever the test publishes."""
    coordinator = FakeCoordinator()
    server, address = start_server(
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server, coordinator
    )
    yield coordinator, address
    coordinator.stop()
    server.stop(0)


@pytest.fixture
def refusing() -> Iterator[tuple[RefusingCoordinator, str]]:
    coordinator = RefusingCoordinator()
    server, address = start_server(
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server, coordinator
    )
    yield coordinator, address
    coordinator.stop()
    server.stop(0)


def test_an_older_generation_is_not_taken_from_the_watch_or_get_cluster(
    deployment: FakeDeployment,
) -> None:
    with collectives.connect(deployment.coordinator_address, timeout=10) as cluster:
        assert cluster.generation == 2
        # The coordinator now answers generation 1 (under a larger version, as a
        # coordinator that numbers its versions apart would).
        deployment.coordinator.publish(deployment.formed_cluster(generation=1))
        stale_version = deployment.coordinator.cluster.version
        assert cluster.refresh(timeout=5).generation == 2
        assert cluster.generation == 2
        # The newer generation that follows is taken, from the watch stream.
        deployment.coordinator.publish(deployment.formed_cluster(generation=3))
        wait_until(lambda: cluster.generation == 3, 10, "the watch to deliver generation 3")
        assert cluster.snapshot().version > stale_version


def test_a_client_of_the_set_never_goes_back_to_an_older_generation(
    deployment: FakeDeployment, other: tuple[FakeCoordinator, str]
) -> None:
    stale, stale_address = other
    for _ in range(deployment.coordinator.cluster.version + 5):  # versions numbered apart
        stale.publish(deployment.formed_cluster(generation=1))
    assert stale.cluster.version > deployment.coordinator.cluster.version
    addresses = f"{deployment.coordinator_address},{stale_address}"
    with collectives.connect(addresses, timeout=10) as cluster:
        # The first answer may be the stale one; asking again reaches the other.
        wait_until(lambda: cluster.refresh(timeout=5).generation == 2, 10, "generation 2")
        for _ in range(2 * 4):  # GetCluster calls alternate between the two coordinators
            assert cluster.refresh(timeout=5).generation == 2
            assert cluster.generation == 2
        # The stale coordinator is asked too, and its answers were not taken.
        assert stale.get_calls > 0


def test_connect_goes_past_a_coordinator_that_refuses(
    deployment: FakeDeployment, refusing: tuple[RefusingCoordinator, str]
) -> None:
    refuser, address = refusing
    for addresses in (
        f"{address},{deployment.coordinator_address}",
        f"{deployment.coordinator_address},{address}",
    ):
        with collectives.connect(addresses, timeout=10) as cluster:
            assert cluster.generation == 2
            for _ in range(4):
                assert cluster.refresh(timeout=5).generation == 2
    assert refuser.get_calls > 0  # it was asked, and passed over


def test_connect_to_a_refusing_coordinator_alone_ends_unavailable_at_its_timeout(
    refusing: tuple[RefusingCoordinator, str],
) -> None:
    coordinator, address = refusing
    started = time.monotonic()
    with pytest.raises(collectives.Unavailable, match="may be stale"):
        collectives.connect(address, timeout=1.0)
    assert 0.5 < time.monotonic() - started < 1.0 + 2.0  # about its timeout
    assert coordinator.get_calls > 1  # asked again within the timeout
