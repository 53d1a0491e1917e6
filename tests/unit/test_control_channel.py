"""The worker's control channel (``worker/control_channel.py``): a generation's
announcements, operand exchanges and outcome agreements over plain TCP.

Each rank runs on its own thread over real loopback sockets and a real store.
The oracle is a gloo process group built over the same store: the same calls,
the same fresh random rows, and every rank must see exactly what gloo gives.
"""

from __future__ import annotations

import datetime
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from collectives.v1 import worker_pb2
from collectives.wire.frames import CONTROL_HELLO, CONTROL_ROW, FRAME_HEADER
from collectives_server.worker.engine import agreement, descriptor, validation
from collectives_server.worker.engine.control_channel import ControlChannel
from collectives_server.worker.kernels import op_failures

TIMEOUT_S = 10.0
HOST = "127.0.0.1"


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        HOST,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


def _client(master: dist.TCPStore, prefix: str) -> dist.Store:
    """One rank's own connection to the store, as each worker process has."""
    client = dist.TCPStore(
        HOST, master.port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    return dist.PrefixStore(prefix, client)


def run_ranks(size: int, fn: Callable[[int], Any], timeout_s: float = 30.0) -> list[Any]:
    """``fn(rank)`` on ``size`` threads; their results in rank order, or the first error."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a rank did not finish in time"
    if errors:
        raise errors[0]
    return results


def channels(store: dist.TCPStore, size: int, timeout_s: float = TIMEOUT_S) -> list[ControlChannel]:
    prefix = f"ch{time.monotonic_ns()}"
    return run_ranks(
        size, lambda r: ControlChannel.connect(_client(store, prefix), r, size, timeout_s, HOST)
    )


def gloo_groups(store: dist.TCPStore, size: int) -> list[dist.ProcessGroup]:
    prefix = f"gloo{time.monotonic_ns()}"
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    return run_ranks(
        size, lambda r: dist.ProcessGroupGloo(_client(store, prefix), r, size, timeout)
    )


def _rounds(pg: Any, rank: int, size: int, rows: list[torch.Tensor], desc) -> tuple:
    """What the op path does: an announcement the leader does not wait for, an exchange
    issued before it waits, then an all-gather of int64 rows and an empty one."""
    if rank == 0:
        pending = descriptor.announce(pg, desc, 40, wait=False)
        got = (desc, 40)
    else:
        pending = None
        got = descriptor.receive(pg)
    gathered = agreement.all_gather_rows(pg, rows[rank], size, pending)
    wide = agreement.all_gather_rows(pg, rows[rank].to(torch.int64) * 7, size)
    empty = agreement.all_gather_rows(pg, torch.empty(0, dtype=torch.uint8), size)
    return got, gathered, wide, empty


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_round_gives_what_gloo_gives(size: int) -> None:
    store = _store()
    rows = [torch.randint(0, 256, (97,), dtype=torch.uint8) for _ in range(size)]
    # Longer than one announcement slot: the descriptor's tail takes a second broadcast.
    desc = worker_pb2.OpDescriptor(op_id=int(torch.randint(1, 1 << 30, ())), generation=3)
    desc.tensor.name = "t/" + "x" * (descriptor.SLOT_BYTES + 100)
    chans = channels(store, size)
    groups = gloo_groups(store, size)
    try:
        ours = run_ranks(size, lambda r: _rounds(chans[r], r, size, rows, desc))
        theirs = run_ranks(size, lambda r: _rounds(groups[r], r, size, rows, desc))
    finally:
        for ch in chans:
            ch.close()
    for rank in range(size):
        (got_desc, got_inline), gathered, wide, empty = ours[rank]
        (want_desc, want_inline), want_gathered, want_wide, want_empty = theirs[rank]
        assert got_desc == want_desc == desc and got_inline == want_inline == 40
        assert torch.equal(gathered, want_gathered)
        assert torch.equal(gathered, torch.stack(rows))
        assert torch.equal(wide, want_wide) and wide.dtype == torch.int64
        assert empty.shape == want_empty.shape == (size, 0)


def test_many_ops_in_a_row_stay_in_step() -> None:
    """Thousands of announce/exchange/agree rounds: every rank sees every op's rows."""
    size = 3
    store = _store()
    chans = channels(store, size)
    ops = 300
    rows = torch.randint(0, 1 << 20, (ops, size, 5), dtype=torch.int64)

    def body(rank: int) -> list[torch.Tensor]:
        out = []
        for i in range(ops):
            desc = worker_pb2.OpDescriptor(op_id=i + 1)
            if rank == 0:
                pending = descriptor.announce(chans[0], desc, None, wait=False)
            else:
                pending = None
                assert descriptor.receive(chans[rank])[0].op_id == i + 1
            out.append(agreement.all_gather_rows(chans[rank], rows[i, rank], size, pending))
        return out

    try:
        results = run_ranks(size, body)
    finally:
        for ch in chans:
            ch.close()
    for rank in range(size):
        for i in range(ops):
            assert torch.equal(results[rank][i], rows[i])


def test_a_peer_that_closes_breaks_the_round_at_once_as_a_transport_failure() -> None:
    store = _store()
    chans = channels(store, 2)
    chans[1].close()
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        agreement.all_gather_rows(chans[0], torch.arange(4, dtype=torch.uint8), 2)
    assert time.monotonic() - started < TIMEOUT_S / 2  # not the timeout: the close
    assert "rank 1" in str(info.value)
    assert op_failures.is_transport_failure(info.value)
    chans[0].close()
    with pytest.raises(RuntimeError, match="torn down"):
        agreement.all_gather_rows(chans[0], torch.arange(4, dtype=torch.uint8), 2)


def test_a_silent_peer_fails_the_round_after_the_timeout() -> None:
    store = _store()
    chans = channels(store, 2, timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timed out after 0\.5s waiting for rank 0") as info:
            descriptor.receive(chans[1])  # the leader announces nothing
        assert 0.5 <= time.monotonic() - started < 5.0
        assert op_failures.is_transport_failure(info.value)
    finally:
        for ch in chans:
            ch.close()


def test_ranks_out_of_step_fail_loudly() -> None:
    """A follower waiting for an all-gather's table that receives an announcement
    says so, instead of reading one op's bytes as another's."""
    store = _store()
    chans = channels(store, 2)

    def body(rank: int) -> None:
        if rank == 0:
            descriptor.announce(chans[0], worker_pb2.OpDescriptor(op_id=1))
        else:
            agreement.all_gather_rows(chans[1], torch.ones(3, dtype=torch.uint8), 2)

    try:
        with pytest.raises(RuntimeError, match="out of step with rank 0: expected a table"):
            run_ranks(2, body)
    finally:
        for ch in chans:
            ch.close()


def _hello(token: bytes, opening: bytes = b"CBC1", kind: int = CONTROL_HELLO) -> bytes:
    return opening + token + FRAME_HEADER.pack(kind, 4) + (1).to_bytes(4, "little")


@pytest.mark.parametrize(
    "hello",
    [
        pytest.param(lambda token: _hello(bytes(16)), id="wrong-token"),
        pytest.param(lambda token: _hello(token, b"CBC9"), id="another-version"),
        pytest.param(lambda token: _hello(token, b"CBL1"), id="a-lane-prelude"),
        pytest.param(lambda token: _hello(token, kind=CONTROL_ROW), id="not-a-hello"),
    ],
)
def test_a_stranger_connecting_first_is_ignored(hello: Callable[[bytes], bytes]) -> None:
    """A connection that does not say the group's hello (a port scanner, a stale rank,
    a worker of a release with another control-channel version) does not take a rank's
    place and is closed at once; the group still forms."""
    store = _store()
    size = 2

    def stranger() -> None:
        store_view = _client(store, "stranger")
        store_view.wait(["address"], datetime.timedelta(seconds=TIMEOUT_S))
        dial, port, token = store_view.get("address").decode().split("\n")
        with socket.create_connection((dial, int(port)), timeout=TIMEOUT_S) as s:
            s.sendall(hello(bytes.fromhex(token)))  # claims rank 1
            s.settimeout(TIMEOUT_S)
            assert s.recv(1) == b""  # the leader closes it

    def body(rank: int) -> ControlChannel:
        if rank == 1:
            stranger()
        return ControlChannel.connect(_client(store, "stranger"), rank, size, TIMEOUT_S, HOST)

    chans = run_ranks(size, body)
    try:
        rows = run_ranks(
            size,
            lambda r: agreement.all_gather_rows(
                chans[r], torch.full((2,), r + 5, dtype=torch.uint8), size
            ),
        )
        assert torch.equal(rows[0], torch.tensor([[5, 5], [6, 6]], dtype=torch.uint8))
    finally:
        for ch in chans:
            ch.close()


def test_a_rank_that_never_connects_fails_the_leader_in_time() -> None:
    store = _store()

    def body(rank: int) -> BaseException | None:
        try:
            ControlChannel.connect(_client(store, "absent"), rank, 3, 2.0, HOST).close()
        except RuntimeError as exc:
            return exc
        return None

    started = time.monotonic()
    leader, follower = run_ranks(2, body)  # rank 2 of 3 never comes
    # It ends, with errors naming the 2 s timeout: no hang. How soon is the machine's
    # business (a loaded one starved these threads for seconds), so the bound only
    # tells an end from a hang; 2 s lets the follower connect however loaded.
    assert time.monotonic() - started < 30.0
    assert "2s" in str(leader), leader
    # It names the rank that never came; on a loaded machine the follower, which must
    # first read the leader's address, may not have connected within 2 s either.
    named = re.search(r"rank\(s\) \[([\d, ]+)\] to connect", str(leader))
    assert named is not None, leader
    missing = {int(r) for r in named.group(1).split(",")}
    assert 2 in missing and missing <= {1, 2}, leader
    # No answer from the leader within its timeout; on a loaded machine the leader may
    # not even have published its address within the follower's 2 s.
    assert "rank 0" in str(follower) or "the leader's address" in str(follower), follower


@pytest.mark.parametrize("length", [0, 1, 1023, 1024, 70_000])
def test_announcements_of_any_length_arrive_whole_and_rows_arrive_aligned(length: int) -> None:
    """The channel's own interface: one message of any length (over gloo a second
    broadcast carries what does not fit the slot), then a table whose rows start
    16-byte aligned, so that tensors can view the operands inside it."""
    size = 3
    store = _store()
    chans = channels(store, size)
    message = bytes(torch.randint(0, 256, (length,), dtype=torch.uint8).tolist())
    rows = [bytes(torch.randint(0, 256, (48,), dtype=torch.uint8).tolist()) for _ in range(size)]

    def body(rank: int) -> tuple[bytes, memoryview]:
        if rank == 0:
            assert chans[0].announce(message) is None  # sent when it returns
            got = message
        else:
            got = chans[rank].receive_announcement(len(message))
        return got, chans[rank].all_gather(rows[rank])

    try:
        results = run_ranks(size, body)
    finally:
        for ch in chans:
            ch.close()
    for got, table in results:
        assert got == message
        assert bytes(table) == b"".join(rows)
        assert torch.frombuffer(table, dtype=torch.uint8).data_ptr() % 16 == 0


def test_an_announcement_longer_than_the_receiver_allows_is_refused() -> None:
    store = _store()
    chans = channels(store, 2)

    def body(rank: int) -> None:
        if rank == 0:
            chans[0].announce(b"x" * 100)
        else:
            chans[1].receive_announcement(99)

    try:
        with pytest.raises(RuntimeError, match="announcement of at most 99 bytes, got a broadcast"):
            run_ranks(2, body)
    finally:
        for ch in chans:
            ch.close()


def _operand(gen: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex or dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(-100, 100, shape, generator=gen, dtype=dtype)


FUSED_DTYPES = (torch.float64, torch.complex128, torch.int16, torch.bool, torch.bfloat16)


def test_fused_exchanges_give_what_gloo_gives_and_operands_read_back_as_put() -> None:
    """Several ops' infos and inline operands in one row (as a fused run exchanges
    them), over the channel and over gloo: the same infos, and every rank reads back
    each rank's operand exactly, whatever its dtype's alignment needs."""
    size = 3
    store = _store()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    shapes = [(3,), (2, 2), (5,), (7,), (1, 3)]
    operands = [
        [_operand(gen, dtype, shape) for dtype, shape in zip(FUSED_DTYPES, shapes, strict=True)]
        for _ in range(size)
    ]
    capacity = [-(-t.numel() * t.element_size() // 16) * 16 for t in operands[0]]

    def body(pg: Any, rank: int) -> list[agreement.Exchanged]:
        parts = [
            (validation.info_values(t, True, (rank, 1 << 20)), t, cap)
            for t, cap in zip(operands[rank], capacity, strict=True)
        ]
        return agreement.exchange_fused(pg, size, parts)

    chans = channels(store, size)
    groups = gloo_groups(store, size)
    try:
        ours = run_ranks(size, lambda r: body(chans[r], r))
        theirs = run_ranks(size, lambda r: body(groups[r], r))
    finally:
        for ch in chans:
            ch.close()
    for rank in range(size):
        for i, (got, want) in enumerate(zip(ours[rank], theirs[rank], strict=True)):
            assert got.infos == want.infos
            for src in range(size):
                info = got.infos[src]
                assert info.held == src
                value = got.payload(src, info)
                assert value.dtype == FUSED_DTYPES[i] and torch.equal(value, operands[src][i])
                assert torch.equal(value, want.payload(src, want.infos[src]))


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_leader_on_a_wildcard_host_is_dialled_by_this_machines_name(host: str) -> None:
    """As a worker started with ``--host 0.0.0.0`` advertises ``gethostname()``."""
    if host == "::" and not socket.has_dualstack_ipv6():
        pytest.skip("this machine has no dual-stack IPv6 sockets")
    store = _store()
    chans = run_ranks(
        2, lambda r: ControlChannel.connect(_client(store, host), r, 2, TIMEOUT_S, host)
    )
    try:
        rows = [torch.randint(0, 256, (4,), dtype=torch.uint8) for _ in range(2)]
        got = run_ranks(2, lambda r: agreement.all_gather_rows(chans[r], rows[r], 2))
        assert all(torch.equal(g, torch.stack(rows)) for g in got)
    finally:
        for ch in chans:
            ch.close()
