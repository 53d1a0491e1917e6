"""The data-plane bounds without a network: slots, the watchdog on a fake clock, peers."""

from __future__ import annotations

import pytest

from collectives_server.rpc.limits import RpcLimits, StreamSlots, Watchdog, peer_host, pool_size


@pytest.mark.parametrize(
    ("peer", "host"),
    [("ipv4:127.0.0.1:5000", "127.0.0.1"), ("ipv6:[::1]:7", "::1"), ("unix:/tmp/s", "unix:/tmp/s")],
)
def test_peer_host(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def test_slots_cap_in_all_and_per_host() -> None:
    slots = StreamSlots(total=3, per_peer=2)
    assert slots.acquire("a") is None and slots.acquire("a") is None
    assert "--max-data-streams-per-peer 2" in (slots.acquire("a") or "")
    assert slots.acquire("b") is None
    assert "--max-data-streams 3" in (slots.acquire("c") or "")
    slots.release("a")
    assert slots.acquire("c") is None and slots.active == 3


def test_the_pool_keeps_threads_no_data_call_can_take() -> None:
    limits = RpcLimits(max_data_streams=10)
    assert pool_size(limits) > limits.max_data_streams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_cuts_idle_streams_and_long_calls_but_not_busy_ones() -> None:
    clock = Clock()
    dog = Watchdog(idle_s=2.0, max_s=10.0, clock=clock, start_thread=False)
    cancelled: list[str] = []
    idle = dog.watch(lambda: cancelled.append("idle"), idle=True)
    busy = dog.watch(lambda: cancelled.append("busy"), idle=True)
    unary = dog.watch(lambda: cancelled.append("unary"), idle=False)
    done = dog.watch(lambda: cancelled.append("done"), idle=True)
    done.done()
    for _ in range(4):  # busy makes progress every second; idle never does
        clock.now += 1.0
        busy.touch()
        for w in dog.expire()[0]:
            w.cancel()
    assert cancelled == ["idle"] and "no progress" in idle.reason
    clock.now += 6.5  # past max_s for the others
    expired, next_deadline = dog.expire()
    assert {w.key for w in expired} == {busy.key, unary.key} and next_deadline is None
    assert all("--max-rpc-s 10" in w.reason for w in expired)


def test_watchdog_heap_stays_proportional_to_live_calls() -> None:
    """Ended unary calls must not pile up until their max_s deadline (at hundreds of
    small ops per second that was hundreds of thousands of entries)."""
    clock = Clock()
    dog = Watchdog(idle_s=2.0, max_s=300.0, clock=clock, start_thread=False)
    cancelled: list[str] = []
    live = [dog.watch(lambda: cancelled.append("live"), idle=False) for _ in range(10)]
    for _ in range(10_000):
        dog.watch(lambda: cancelled.append("ended"), idle=False).done()
        clock.now += 0.001
    assert dog.heap_size <= 2 * len(live) + 64 + 1
    clock.now += 300.0
    expired, _ = dog.expire()
    assert {w.key for w in expired} == {w.key for w in live} and cancelled == []
