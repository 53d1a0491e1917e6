"""The election and the fenced writes of ``EtcdLeadership``, against a real etcd.

No coordinator here: two or three leaderships of one cluster name campaign on
one etcd; the tests check that exactly one leads, that a deposed leader's write
is refused by etcd itself (the fencing token), and that an etcd outage neither
elects two leaders nor loses the document.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request

import grpc
import pytest
from etcd_server import EtcdServer
from helpers import wait_until

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives_server.coordinator.ha.etcd_replication import EtcdReplication
from collectives_server.coordinator.ha.etcd_store import (
    EtcdLeadership,
    NotLeaderError,
    StoreUnavailableError,
    parse_etcd_url,
)
from collectives_server.coordinator.membership import Membership
from collectives_server.coordinator.service import CoordinatorServicer
from collectives_server.rpc.server import start_server

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd")
    yield server
    server.stop()


def _campaigners(etcd: EtcdServer, n: int, name: str = "t") -> list[EtcdLeadership]:
    return [
        EtcdLeadership(etcd.url, name, f"127.0.0.1:{5000 + i}", ttl_s=1).start() for i in range(n)
    ]


def _one_leader(group: list[EtcdLeadership]) -> EtcdLeadership | None:
    leading = [c for c in group if c.leading]
    return leading[0] if len(leading) == 1 else None


def _revoke(etcd: EtcdServer, lease_id: int) -> None:
    body = json.dumps({"ID": lease_id}).encode()
    request = urllib.request.Request(
        f"http://{etcd.endpoint}/v3/kv/lease/revoke", data=body, method="POST"
    )
    urllib.request.urlopen(request, timeout=5).close()


def test_urls_are_checked() -> None:
    assert parse_etcd_url("etcd://a:1,b:2") == [("a", 1), ("b", 2)]
    for bad in ("http://a:1", "etcd://a", "etcd://a:0", "etcd://:1", "etcd://a:1,"):
        with pytest.raises(ValueError):
            parse_etcd_url(bad)


def test_an_unreachable_store_is_refused_at_start() -> None:
    with pytest.raises(StoreUnavailableError, match="no etcd endpoint answered"):
        EtcdLeadership("etcd://127.0.0.1:1", "t", "me").start()


def test_exactly_one_leads_and_the_others_name_it(etcd) -> None:
    group = _campaigners(etcd, 3)
    try:
        leader = wait_until(lambda: _one_leader(group), 10, "one leader")
        wait_until(
            lambda: all(c.leader == leader.identity for c in group), 10, "all to name the leader"
        )
        doc = {"generation": 1, "who": leader.identity}
        leader.persist(doc)
        assert leader.load() == doc
        for other in group:
            if other is not leader:
                with pytest.raises(NotLeaderError):
                    other.persist({"generation": 99})
        assert leader.load() == doc
    finally:
        for c in group:
            c.stop()


def test_a_deposed_leader_cannot_write_even_while_it_believes_it_leads(etcd) -> None:
    a, b = _campaigners(etcd, 2)
    try:
        first = wait_until(lambda: _one_leader([a, b]), 10, "one leader")
        second = b if first is a else a
        first.persist({"generation": 1})
        lease = first._lease_id
        # Freeze its election thread (a paused process): it still holds its token.
        first.stop(resign=False)
        assert first.leading
        _revoke(etcd, lease)  # what a lease running out in etcd does
        wait_until(lambda: second.leading, 10, "the standby to take over")
        second.persist({"generation": 2})
        with pytest.raises(NotLeaderError):
            first.persist({"generation": 1, "stale": True})
        assert not first.leading
        assert second.load() == {"generation": 2}
    finally:
        a.stop()
        b.stop()


def test_a_resigning_leader_hands_over_at_once(etcd) -> None:
    group = _campaigners(etcd, 2)
    try:
        leader = wait_until(lambda: _one_leader(group), 10, "one leader")
        other = group[1] if leader is group[0] else group[0]
        leader.stop(resign=True)
        wait_until(lambda: other.leading, 3, "the standby to lead after a resignation")
    finally:
        for c in group:
            c.stop()


def test_an_etcd_outage_elects_nobody_twice_and_keeps_the_document(etcd) -> None:
    changes: list[tuple[str, bool]] = []
    group = [
        EtcdLeadership(
            etcd.url,
            "t",
            f"127.0.0.1:{5000 + i}",
            ttl_s=1,
            on_change=lambda leading, i=i: changes.append((f"c{i}", leading)),
        ).start()
        for i in range(2)
    ]
    try:
        leader = wait_until(lambda: _one_leader(group), 10, "one leader")
        leader.persist({"generation": 7})
        etcd.stop()
        wait_until(lambda: not any(c.leading for c in group), 10, "everyone to step down")
        wait_until(lambda: all(c.cut_off for c in group), 10, "everyone to know it is cut off")
        etcd.start()
        again = wait_until(lambda: _one_leader(group), 15, "one leader after the outage")
        assert again.load() == {"generation": 7}
        # Leadership moved only through explicit changes, never two at once.
        leading: set[str] = set()
        for who, now_leading in changes:
            if now_leading:
                assert not leading, f"{who} led while {leading} did: {changes}"
                leading.add(who)
            else:
                leading.discard(who)
    finally:
        for c in group:
            c.stop()


def test_the_document_is_json_under_the_cluster_prefix(etcd) -> None:
    (c,) = _campaigners(etcd, 1, name="prefix-check")
    try:
        wait_until(lambda: c.leading, 10, "the only coordinator to lead")
        c.persist({"generation": 3})
        key = base64.b64encode(b"/collectives/prefix-check/state").decode()
        request = urllib.request.Request(
            f"http://{etcd.endpoint}/v3/kv/range",
            data=json.dumps({"key": key}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as reply:
            kvs = json.loads(reply.read())["kvs"]
        assert json.loads(base64.b64decode(kvs[0]["value"])) == {"generation": 3}
    finally:
        c.stop()


def test_a_winner_that_has_not_taken_over_refuses_writes_as_a_standby_would(etcd) -> None:
    """Between the election thread winning and the servicer taking over from the stored
    document, the coordinator still holds a standby's copy: a Register or Heartbeat then
    is UNAVAILABLE (retry), never decided on the copy (which raised: INTERNAL)."""
    leadership = EtcdLeadership(etcd.url, "won", "", ttl_s=2)
    replication = EtcdReplication(leadership, lambda: Membership(1, 2), time.monotonic)
    servicer = CoordinatorServicer(
        Membership(1, 2), heartbeat_s=0.5, op_timeout_s=5, replication=replication
    )
    servicer.on_state(None, 0)  # a standby's copy of what etcd holds: nothing yet
    server = start_server(
        "127.0.0.1",
        0,
        register=[lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s)],
        service_names=["collectives.v1.Coordinator"],
    )
    leadership.identity = f"127.0.0.1:{server.port}"
    won = threading.Event()
    leadership.on_change = lambda leading: won.set() if leading else None  # no take-over yet
    leadership.start()
    try:
        assert won.wait(30), "the only campaigner did not win"
        assert leadership.leading and not servicer.is_leader
        with grpc.insecure_channel(leadership.identity) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            register = coordinator_pb2.RegisterRequest(
                address="127.0.0.1:9", devices=["cpu"], store_port=9
            )
            beat = coordinator_pb2.HeartbeatRequest(worker_id="w-1")
            for call, request in ((stub.Register, register), (stub.Heartbeat, beat)):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
                assert "retry" in refused.value.details(), refused.value.details()
            servicer.on_leadership(True)  # the take-over: now it decides
            assert servicer.is_leader
            joined = stub.Register(register, timeout=10)
            stub.Heartbeat(
                coordinator_pb2.HeartbeatRequest(
                    worker_id=joined.worker_id, lease_secret=joined.lease_secret
                ),
                timeout=10,
            )
    finally:
        leadership.stop()
        server.stop()
