"""A flood of idle connections against one worker and the coordinator, held open.

Shared by the flood row (``row_flood``: how much the flood slows a legitimate
client's all_reduces) and the flood test (tests/integration/test_flood.py:
every op still correct, the daemons healthy, their memory back).

- :func:`idle_streams`: PutTensor streams without a deadline that send a header
  and one chunk, then nothing;
- :func:`idle_sockets`: raw TCP connections (to the bulk port, the dashboard)
  that send a first few bytes, then nothing;
- :func:`taken_in`: whether the daemons' own metrics count every connection of
  the flood (admitted or refused), so measuring starts once the accept loops
  have worked through it, not during that transient.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.request
from collections.abc import Iterator

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from collectives.v1 import worker_pb2
from collectives.wire import codec

__all__ = ["idle_sockets", "idle_streams", "metric", "scrape", "taken_in"]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when the daemon does not export it yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _stalled_put(name: str, stop: threading.Event) -> Iterator[bytes]:
    """A put that declares 1 MiB, sends the header and one chunk, then nothing until stopped."""
    messages = codec.encode_tensor_stream(name, torch.randn(1 << 18), chunk_bytes=1 << 16)
    yield next(messages)
    yield next(messages)
    stop.wait(120)


@contextlib.contextmanager
def idle_streams(address: str, count: int) -> Iterator[list]:
    """``count`` PutTensor streams without a deadline that send one message and stall."""
    stop = threading.Event()
    channels, calls = [], []
    try:
        for i in range(count):
            channel = grpc.insecure_channel(address)
            channels.append(channel)
            put = channel.stream_unary(
                "/collectives.v1.Worker/PutTensor",
                request_serializer=None,
                response_deserializer=worker_pb2.PutTensorResponse.FromString,
            )
            calls.append(put.future(_stalled_put(f"flood/idle{i}", stop)))
        yield calls
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()


@contextlib.contextmanager
def idle_sockets(port: int, count: int, first: bytes = b"") -> Iterator[list]:
    """Up to ``count`` TCP connections to ``port`` that send ``first`` and then nothing
    (a connection refused at the server's cap is not counted)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                continue  # refused at the cap: that is the server defending itself
            if first:
                with contextlib.suppress(OSError):
                    sock.sendall(first)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def taken_in(
    worker_port: int, coordinator_port: int, streams: int, bulk: int, web: int, refused0: float
) -> bool:
    """True once the daemons count every idle connection of the flood (else raises
    AssertionError with the counts)."""
    w, c = scrape(worker_port), scrape(coordinator_port)
    counts = {
        "streams": metric(w, "collectives_data_streams_active"),
        "bulk": metric(w, "collectives_bulk_connections_open")
        + metric(w, "collectives_bulk_connections_refused_total")
        - refused0,
        "dashboard": metric(c, "collectives_dashboard_connections_open")
        + metric(c, "collectives_dashboard_connections_refused_total"),
    }
    expected = {"streams": streams, "bulk": bulk, "dashboard": web}
    assert counts == expected, f"counted {counts}, flood {expected}"
    return True
