"""A call lane under a hostile client: the same limits in bytes and time as gRPC's.

A lane is a raw TCP connection (tests/integration/test_call_lanes.py covers what it
serves). Here a client that promises bytes it never sends, drips a frame a byte
at a time, asks for an answer larger than gRPC would send, or never reads its
answer, gets what a gRPC call would give it, and the worker keeps no memory and
no connection for it beyond the bounds `docs/security.md` lists.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from google.rpc import status_pb2
from helpers import connect_ready, wait_until
from hostile import rss_bytes

import collectives
from collectives.v1 import worker_pb2, worker_pb2_grpc
from collectives.wire.frames import (
    ACK,
    FAILED,
    FRAME_HEADER,
    LANE,
    LANE_REQUEST_HEADER,
    MAX_LANE_REQUEST_BYTES,
    prelude,
)
from collectives.wire.limits import MAX_MESSAGE_BYTES
from collectives_server import model_zoo

ZOO = "collectives_server.model_zoo"
# The lane's idle bound here (the bulk port's, --bulk-idle-s), short so that a frame
# cut at its deadline is seen within seconds.
IDLE_S = 3.0
MiB = 1 << 20
# Forward's lane id: the worker names it first (checked where a lane opens).
FORWARD = 1
TCP_CLOSE = 7  # tcpi_state: the worker reset the connection
TCP_CLOSE_WAIT = 8  # tcpi_state: the worker closed its end
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def attacked(local_cluster) -> Iterator[collectives.Cluster]:
    client = connect_ready(
        local_cluster(2, "--allow-factory", ZOO, "--bulk-idle-s", str(IDLE_S)), 2
    )
    # 4 inputs, 2,048 outputs: a batch of 1,024 rows answers 8 MiB.
    client.load_model(
        "wide", factory=f"{ZOO}:mlp", kwargs={"in_features": 4, "hidden": 8, "out_features": 2048}
    )
    yield client
    client.close()


def _worker(client: collectives.Cluster):
    return next(w for w in client.workers() if w.rank == 1)


def _open_lane(address: str, rcvbuf: int = 0) -> socket.socket:
    with grpc.insecure_channel(address) as channel:
        answer = worker_pb2_grpc.WorkerStub(channel).GetDataPlane(
            worker_pb2.DataPlaneRequest(open_lane=True), timeout=10
        )
    assert answer.lane_methods[FORWARD - 1] == "Forward"
    sock = socket.socket()
    if rcvbuf:  # before connecting, so that the window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((address.rpartition(":")[0], answer.bulk_port))
    sock.sendall(prelude(LANE, answer.lane_ticket))
    assert sock.recv(1) == ACK
    return sock


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def _closed_by_worker(sock: socket.socket) -> bool:
    """The worker closed the lane: reads end (at EOF or a reset) within 10 s."""
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def _forward_request(client: collectives.Cluster, rows: int, gen: torch.Generator) -> bytes:
    x = torch.randn(rows, 4, generator=gen)
    client.put("lane-attack/x", x, rank=1)
    request = worker_pb2.ForwardRequest(
        model="wide",
        call_id=f"lane-attack-{rows}-{time.monotonic_ns()}",
        args=worker_pb2.Value(
            tuple=worker_pb2.ValueList(items=[worker_pb2.Value(tensor="lane-attack/x")])
        ),
        inline_output_bytes=64 * MiB,
    )
    return request.SerializeToString()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def test_headers_promising_megabytes_reserve_nothing(attacked) -> None:
    """32 lanes each send a header announcing the largest request, and one byte: the
    worker holds the byte, not the 4 MiB announced (32 x 4 MiB before), and cuts
    each lane when its frame's deadline passes."""
    worker = _worker(attacked)
    lanes = [_open_lane(worker.address) for _ in range(32)]
    try:
        before = rss_bytes(worker.pid)
        for lane in lanes:
            lane.sendall(LANE_REQUEST_HEADER.pack(FORWARD, MAX_LANE_REQUEST_BYTES, 30.0) + b"\0")
        peak = before

        def all_cut() -> bool:
            nonlocal peak
            peak = max(peak, rss_bytes(worker.pid))
            return all(_tcp_state(lane) == TCP_CLOSE_WAIT for lane in lanes)

        wait_until(all_cut, IDLE_S + 30, "the worker to cut the 32 unfinished frames")
    finally:
        for lane in lanes:
            lane.close()
    assert peak - before < 16 * MiB, f"grew {(peak - before) / MiB:.0f} MiB for 32 bytes"


def test_a_frame_dripped_a_byte_at_a_time_is_cut_at_its_deadline(attacked) -> None:
    """A byte every 0.5 s keeps no lane open past its frame's deadline (the idle
    bound once counted from each byte, so a drip held a lane for ever): the lane is
    cut within a few idle bounds, while a byte still comes every 0.5 s."""
    worker = _worker(attacked)
    lane = _open_lane(worker.address)
    started = time.monotonic()
    with lane:
        lane.sendall(LANE_REQUEST_HEADER.pack(FORWARD, 1000, 30.0))
        dripped = 0
        try:
            while time.monotonic() - started < 6 * IDLE_S and dripped < 64:
                lane.sendall(b"\0")
                dripped += 1
                if _tcp_state(lane) == TCP_CLOSE_WAIT:
                    break
                time.sleep(0.5)  # the attacker's pace, not a wait for the worker
        except OSError:
            pass  # the worker reset the lane: cut
        cut_after = time.monotonic() - started
    assert cut_after < 4 * IDLE_S, f"a dripping lane stayed open {cut_after:.1f} s"


def test_an_answer_grpc_would_refuse_is_refused_on_a_lane_too(attacked, gen) -> None:
    """An 8 MiB answer: gRPC ends the call RESOURCE_EXHAUSTED ("Sent message larger
    than max"); the lane gives the same status, and goes on serving."""
    worker = _worker(attacked)
    request = _forward_request(attacked, 1024, gen)
    with grpc.insecure_channel(worker.address) as channel:
        forward = channel.unary_unary(
            "/collectives.v1.Worker/Forward",
            request_serializer=None,
            response_deserializer=worker_pb2.ForwardResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as over_grpc:
            forward(request, timeout=30)
    assert over_grpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with _open_lane(worker.address) as lane:
        lane.sendall(LANE_REQUEST_HEADER.pack(FORWARD, len(request), 30.0) + request)
        outcome, size = FRAME_HEADER.unpack(_recv_exactly(lane, FRAME_HEADER.size))
        body = _recv_exactly(lane, size)
        assert outcome == FAILED, f"an answer of {size} bytes was sent on a lane"
        status = status_pb2.Status.FromString(body)
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "Sent message larger than max" in status.message
        assert f"vs. {MAX_MESSAGE_BYTES})" in status.message
        # The lane goes on: a 16-row forward answers.
        small = _forward_request(attacked, 16, gen)
        lane.sendall(LANE_REQUEST_HEADER.pack(FORWARD, len(small), 30.0) + small)
        outcome, size = FRAME_HEADER.unpack(_recv_exactly(lane, FRAME_HEADER.size))
        _recv_exactly(lane, size)
        assert outcome != FAILED


def test_an_answer_nobody_reads_is_dropped_at_the_calls_deadline(attacked, gen) -> None:
    """A client that sends a call with a 2 s deadline and never reads its 3.9 MiB
    answer: the worker drops it, and resets the lane, once the deadline (and a
    second's grace) passed, instead of holding it for the lane's idle bound."""
    worker = _worker(attacked)
    request = _forward_request(attacked, 500, gen)  # 500 x 2,048 floats: 3.9 MiB
    assert MAX_MESSAGE_BYTES > 500 * 2048 * 4
    # A window of a few KiB: the answer cannot hide in the kernel's buffers.
    lane = _open_lane(worker.address, rcvbuf=4096)
    with lane:
        lane.sendall(LANE_REQUEST_HEADER.pack(FORWARD, len(request), 2.0) + request)
        # Reset, not closed: a FIN would wait behind the megabytes nobody reads.
        wait_until(
            lambda: _tcp_state(lane) == TCP_CLOSE,
            30,
            "the worker to drop the unread answer and reset the lane",
        )
        assert _closed_by_worker(lane)
    # The worker serves on, on lanes: the model's output for fresh rows.
    x = torch.randn(3, 4, generator=gen)
    state = attacked.state_dict("wide")
    reference = model_zoo.mlp(in_features=4, hidden=8, out_features=2048)
    reference.load_state_dict(state)
    with torch.no_grad():
        got = attacked.data_parallel("wide", timeout=30)(x)
        torch.testing.assert_close(got, reference(x), atol=1e-5, rtol=1e-4)
