"""Coordinator failover on a real etcd: 3 coordinators, real workers and clients.

1. SIGKILL of the leading coordinator while 8 clients run collectives: no op
   fails, a standby leads within the lease TTL + 2 s, a worker killed next is
   dropped and a smaller generation is sealed by the new leader.
2. etcd stopped for 10 s: ops keep working, a membership change waits, and
   resumes once etcd is back; the stored state is intact.
3. The leader cut off from etcd (a partition, by a proxy) steps down; a standby
   leads; every generation in the history has one sealer and numbers only grow.
4. etcd stopped for 10 s, another coordinator leads after it, a worker is lost and
   the next generation sealed while the old leader's reads of etcd are held up:
   no coordinator answers an older generation, and a fresh client, given any one
   address or the whole list, sees the newest generation or a clean UNAVAILABLE.

``COLLECTIVES_HA_RUNS`` repeats the first scenario (10 for a thorough run),
``COLLECTIVES_HA_STALE_RUNS`` the fourth.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import torch
from ha_harness import LEADER_TTL_S, TAKEOVER_BOUND_S, HaCluster, cluster_of, stored_state
from harness import LEASE_S, checksum, put_checksummed, record, wait_until

import collectives
from collectives.v1 import coordinator_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUNS = int(os.environ.get("COLLECTIVES_HA_RUNS", "1"))
STALE_RUNS = int(os.environ.get("COLLECTIVES_HA_STALE_RUNS", "1"))
CLIENTS = 8


@pytest.fixture
def ha(tmp_path):
    clusters: list[HaCluster] = []

    def start(**kwargs) -> HaCluster:
        cluster = HaCluster(tmp_path, **kwargs)
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.close()


class Clients:
    """``n`` SDK clients, each all-reducing fresh random tensors under its own name and
    checking every result against torch's sum of the same inputs."""

    def __init__(self, addresses: str, n: int) -> None:
        self.stop = threading.Event()
        self.done = [0] * n
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(addresses, k), daemon=True) for k in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self, addresses: str, k: int) -> None:
        gen = torch.Generator().manual_seed(1000 + k)
        try:
            client = collectives.connect(addresses, timeout=30)
        except Exception as exc:
            with self._lock:
                self.failures.append(f"client {k} connect: {exc!r}")
            return
        try:
            for _ in range(100_000):  # bounded; ends on stop
                if self.stop.is_set():
                    return
                world = client.world_size
                parts = [torch.randn(256, generator=gen) for _ in range(world)]
                for rank, part in enumerate(parts):
                    client.put(f"c{k}", part, rank=rank)
                client.all_reduce(f"c{k}")
                got = client.get(f"c{k}", rank=world - 1)
                torch.testing.assert_close(got, sum(parts), rtol=1e-5, atol=1e-5)
                with self._lock:
                    self.done[k] += 1
        except Exception as exc:
            with self._lock:
                self.failures.append(f"client {k}: {exc!r}")
        finally:
            client.close()

    def each_did(self, at_least: list[int]) -> bool:
        with self._lock:
            return all(d >= n for d, n in zip(self.done, at_least, strict=True))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads), "a client thread hangs"


def _check_history(cluster: HaCluster, leaders: set[str]) -> list:
    history = cluster.client.snapshot().history
    numbers = [r.generation for r in history]
    assert numbers == sorted(set(numbers)), f"generations not strictly increasing: {numbers}"
    for record_ in history:
        assert record_.sealed_by in leaders, f"generation {record_.generation} sealed by {record_}"
    return history


@pytest.mark.parametrize("run", range(RUNS))
def test_leader_sigkill_under_8_clients_fails_no_op(ha, gen, run) -> None:
    cluster = ha(workers=3, min_workers=2)
    sums = put_checksummed(cluster, "keep", gen)
    first = cluster.wait_for_leader()
    first_address = f"127.0.0.1:{cluster.ports[first]}"
    clients = Clients(cluster.addresses, CLIENTS)
    wait_until(lambda: clients.each_did([3] * CLIENTS), 60, "every client to run 3 ops")
    before = list(clients.done)
    killed_at = time.monotonic()
    cluster.coordinators[first].signal(signal.SIGKILL)
    new = cluster.wait_for_leader(TAKEOVER_BOUND_S + 5, other_than=first)
    takeover_s = time.monotonic() - killed_at
    new_address = f"127.0.0.1:{cluster.ports[new]}"
    # Ops after the takeover, on every client, still correct.
    wait_until(lambda: clients.each_did([n + 3 for n in before]), 60, "3 more ops on every client")
    clients.finish()
    assert not clients.failures, clients.failures
    assert takeover_s <= LEADER_TTL_S + 2.0, f"takeover took {takeover_s:.2f} s"
    # A worker killed now: the new leader drops it and seals a smaller generation.
    generation = cluster.client.generation
    members = cluster.members()
    victim = cluster.daemon_at(members[1].address)
    killed_at = time.monotonic()
    victim.signal(signal.SIGKILL)
    cluster.wait_ready(2, after_generation=generation, timeout_s=LEASE_S + 15)
    resealed_s = time.monotonic() - killed_at
    history = _check_history(cluster, {first_address, new_address})
    assert history[-1].sealed_by == new_address and history[-1].world_size == 2
    assert stored_state(cluster.etcd, cluster.name)["generation"] == cluster.client.generation
    for w in cluster.members():
        assert checksum(cluster.client.get("keep", rank=w.rank)) == sums[w.address]
    record(
        "HA: SIGKILL leader coordinator",
        takeover_s,
        resealed_s,
        f"{sum(clients.done)} ops by {CLIENTS} clients, 0 failed; worker lost -> gen "
        f"{cluster.client.generation} sealed by the new leader",
    )


def test_etcd_stopped_for_10_s(ha, gen) -> None:
    cluster = ha(workers=3, min_workers=2)
    sums = put_checksummed(cluster, "keep", gen)
    generation = cluster.client.generation
    client = cluster.client
    members = cluster.members()
    stopped_at = time.monotonic()
    cluster.etcd.stop()
    ops = 0
    previous: torch.Tensor | None = None
    while time.monotonic() - stopped_at < 5.0 and ops < 10_000:  # ops on the formed cluster
        parts = [torch.randn(64, generator=gen) for _ in members]
        for w, t in zip(members, parts, strict=True):
            client.put("x", t, rank=w.rank)
        client.all_reduce("x")
        got = client.get("x", rank=0)
        if not torch.allclose(got, sum(parts), rtol=1.3e-6, atol=1e-5):
            raise AssertionError(_wrong_sum(client, members, parts, previous, got, ops))
        previous = got
        ops += 1
    assert ops > 0
    victim = cluster.daemon_at(members[2].address)
    victim.signal(signal.SIGKILL)
    # Well past the worker's lease, etcd still away: no coordinator announces a change.
    deadline = stopped_at + 10.0
    while time.monotonic() < deadline:
        for i in cluster.live_coordinators():
            try:
                seen = cluster_of(f"127.0.0.1:{cluster.ports[i]}")
            except Exception:
                continue  # a coordinator cut off from etcd refuses reads: fine
            assert seen.generation == generation, "a generation was sealed without etcd"
        time.sleep(0.2)  # polling what the coordinators show, not synchronisation
    restarted_at = time.monotonic()
    cluster.etcd.start()
    cluster.wait_ready(2, after_generation=generation, timeout_s=LEASE_S + 20)
    resumed_s = time.monotonic() - restarted_at
    state = stored_state(cluster.etcd, cluster.name)
    assert state["generation"] == cluster.client.generation == generation + 1
    _check_history(cluster, {f"127.0.0.1:{p}" for p in cluster.ports})
    for w in cluster.members():
        assert checksum(cluster.client.get("keep", rank=w.rank)) == sums[w.address]
    record("HA: etcd stopped 10 s", 0.0, resumed_s, f"{ops} ops during the outage, 0 failed")


def _wrong_sum(client, members, parts, previous, got, ops: int) -> str:
    """What a wrong all_reduce sum was made of: which rank's operand it lacks, and
    whether the previous sum stood in for it (a put that an earlier op's late commit
    on that rank overwrote), so a failure says which way it went wrong."""
    expected = sum(parts)
    lines = [
        f"op {ops}: all_reduce sum on rank 0 is wrong (max error "
        f"{float((got - expected).abs().max()):.4g})"
    ]
    for k, w in enumerate(members):
        without = expected - parts[k]
        if previous is not None and torch.allclose(got, without + previous, atol=1e-4):
            lines.append(
                f"  it is the sum with rank {w.rank}'s operand replaced by the previous sum"
            )
        elif torch.allclose(got, without, atol=1e-4):
            lines.append(f"  it is the sum without rank {w.rank}'s operand")
    for w in members:
        held = client.get("x", rank=w.rank)
        lines.append(f"  rank {w.rank} ({w.address}) now holds the same: {torch.equal(held, got)}")
    snap = client.snapshot()
    lines.append(
        f"  generation {snap.generation}, digest {snap.membership_digest}, "
        f"members {[(w.rank, w.address) for w in snap.workers]}"
    )
    return "\n".join(lines)


def test_a_leader_partitioned_from_etcd_steps_down(ha, gen) -> None:
    cluster = ha(workers=3, min_workers=2)
    first = cluster.wait_for_leader()
    generation = cluster.client.generation
    cut_at = time.monotonic()
    cluster.proxies[first].cut()
    others = [i for i in cluster.live_coordinators() if i != first]

    def new_leader() -> tuple[int] | None:
        named = {cluster_of(f"127.0.0.1:{cluster.ports[i]}").leader for i in others}
        if len(named) != 1:
            return None
        (address,) = named
        found = [i for i in others if address == f"127.0.0.1:{cluster.ports[i]}"]
        return (found[0],) if found else None

    (new,) = wait_until(new_leader, TAKEOVER_BOUND_S + 5, "a standby to lead")
    takeover_s = time.monotonic() - cut_at

    # The partitioned one refuses reads (its copy may be stale) and no longer leads.
    def refuses_reads() -> bool:
        try:
            cluster_of(f"127.0.0.1:{cluster.ports[first]}")
        except grpc.RpcError as err:
            return err.code() == grpc.StatusCode.UNAVAILABLE and "not reached etcd" in err.details()
        return False

    wait_until(refuses_reads, LEADER_TTL_S + 2, "the partitioned coordinator to refuse reads")
    members = cluster.members()
    cluster.daemon_at(members[1].address).signal(signal.SIGKILL)
    cluster.wait_ready(2, after_generation=generation, timeout_s=LEASE_S + 15)
    cluster.proxies[first].restore()
    wait_until(
        lambda: cluster.leader() == new, 15, "the healed coordinator to follow the new leader"
    )  # == new: a bool, never the index itself
    new_address = f"127.0.0.1:{cluster.ports[new]}"
    first_address = f"127.0.0.1:{cluster.ports[first]}"
    history = _check_history(cluster, {first_address, new_address})
    after = [r for r in history if r.generation > generation]
    assert after and all(r.sealed_by == new_address for r in after), after
    record("HA: leader cut off from etcd", takeover_s, 0.0, f"new leader {new_address}")


# Scenario 4: a longer leader TTL, so that a coordinator cut off from etcd goes on
# believing it is in touch (it refuses reads only after a TTL of silence) for longer
# than a lost worker takes to be replaced by a new generation.
STALE_TTL_S = 4
OUTAGE_S = 10.0
FRESH_CONNECT_S = 3.0


def _answer(address: str) -> coordinator_pb2.Cluster | grpc.RpcError:
    """One GetCluster from ``address``: its Cluster, or the error it answered."""
    try:
        return cluster_of(address)
    except grpc.RpcError as err:
        return err


def _not_older(what: str, answer: coordinator_pb2.Cluster | grpc.RpcError, newest: int) -> None:
    """``answer`` is generation ``newest`` or later, or a clean UNAVAILABLE that says why."""
    if isinstance(answer, grpc.RpcError):
        assert answer.code() == grpc.StatusCode.UNAVAILABLE, (what, answer.code(), answer.details())
        assert "may be stale" in answer.details(), (what, answer.details())
        return
    assert answer.generation >= newest, (
        f"{what} answered generation {answer.generation} ({answer.world_size} workers) "
        f"after generation {newest} was sealed"
    )


def _fresh_client(address: str) -> int | collectives.Unavailable:
    """The generation a new ``collectives.connect(address)`` sees, or its Unavailable."""
    try:
        with collectives.connect(address, timeout=FRESH_CONNECT_S) as fresh:
            return fresh.generation
    except collectives.Unavailable as err:
        return err


def _agreed_leader(cluster: HaCluster, among: list[int]) -> tuple[int] | None:
    """The index every coordinator of ``among`` names as leader, when they agree on one of them."""
    named = set()
    for i in among:
        answer = _answer(cluster.address(i))
        if isinstance(answer, grpc.RpcError):
            return None
        named.add(answer.leader)
    found = [i for i in among if named == {cluster.address(i)}]
    return (found[0],) if found else None


@pytest.mark.parametrize("run", range(STALE_RUNS))
def test_no_coordinator_serves_an_older_generation_after_an_etcd_outage(ha, run) -> None:
    cluster = ha(workers=3, min_workers=2, leader_ttl_s=STALE_TTL_S)
    old = cluster.wait_for_leader()
    generation = cluster.client.generation
    indices = list(range(len(cluster.ports)))
    addresses = [cluster.address(i) for i in indices]

    # etcd stops: every coordinator is cut off from it, the leader steps down.
    stopped_at = time.monotonic()
    cluster.etcd.stop()

    def all_refuse() -> bool:
        answers = [_answer(a) for a in addresses]
        for a, answer in zip(addresses, answers, strict=True):
            _not_older(a, answer, generation)
        return all(isinstance(answer, grpc.RpcError) for answer in answers)

    wait_until(all_refuse, STALE_TTL_S + 5, "every coordinator to refuse reads without etcd")
    while time.monotonic() - stopped_at < OUTAGE_S:  # the outage lasts; nothing is sealed
        for a in addresses:
            answer = _answer(a)
            if not isinstance(answer, grpc.RpcError):
                assert answer.generation == generation, "a generation was sealed without etcd"
        time.sleep(0.2)  # polling what the coordinators show, not synchronisation

    # etcd returns while the old leader still cannot reach it: another one leads.
    cluster.proxies[old].cut()
    restarted_at = time.monotonic()
    cluster.etcd.start()
    others = [i for i in indices if i != old]
    (new,) = wait_until(
        lambda: _agreed_leader(cluster, others), 2 * STALE_TTL_S + 10, "a standby to lead"
    )
    takeover_s = time.monotonic() - restarted_at
    cluster.proxies[old].restore()

    def old_stands_by() -> bool:
        answer = _answer(cluster.address(old))
        return not isinstance(answer, grpc.RpcError) and answer.leader == cluster.address(new)

    wait_until(old_stands_by, STALE_TTL_S + 10, "the old leader to stand by the new one")

    # The old leader's reads of etcd are held up (as an etcd slow after its restart
    # holds them) while a worker is lost and the new leader seals the next generation.
    cluster.proxies[old].cut()
    # The takeover re-forms the cluster (on a loaded machine a 1.5 s lease can lose a
    # worker on the way): pick the victim among the members the client sees once formed.
    members = wait_until(cluster.members, LEASE_S + 15, "the client to see the members")
    victim = cluster.daemon_at(members[-1].address)
    victim.signal(signal.SIGKILL)
    cluster.wait_ready(2, after_generation=generation, timeout_s=LEASE_S + 15)
    newest = cluster.client.generation
    for i in [old, *others]:
        _not_older(f"coordinator {i} (old leader: {old})", _answer(addresses[i]), newest)
    for i in [old, *others]:
        seen = _fresh_client(addresses[i])
        if isinstance(seen, int):
            assert seen >= newest, f"a client of coordinator {i} (old leader {old}) saw {seen}"
        else:
            assert "may be stale" in str(seen), seen
    seen = _fresh_client(cluster.addresses)
    assert isinstance(seen, int) and seen >= newest, (seen, newest)
    history = cluster.client.snapshot().history
    assert history[-1].sealed_by == cluster.address(new) and history[-1].world_size == 2

    # Back in touch with etcd, the old leader serves the newest generation again.
    restored_at = time.monotonic()
    cluster.proxies[old].restore()

    def caught_up() -> bool:
        answer = _answer(cluster.address(old))
        return not isinstance(answer, grpc.RpcError) and answer.generation >= newest

    wait_until(caught_up, STALE_TTL_S + 10, "the old leader to serve the newest generation")
    caught_up_s = time.monotonic() - restored_at
    assert _fresh_client(cluster.address(old)) == cluster.client.generation >= newest
    record(
        "HA: no older generation served",
        takeover_s,
        caught_up_s,
        f"etcd away {OUTAGE_S:g} s, new leader {cluster.address(new)}, gen {newest} sealed; "
        "the old leader refused reads until it could check its copy",
    )
