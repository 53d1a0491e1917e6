"""A TLS client never dials a plaintext road: no bulk transfer, no call lane.

The bulk port and the call lanes on it are raw TCP. A worker under TLS offers
neither; but a plaintext worker behind a TLS proxy on the same host would, and a
TLS client that took the offer would send calls and tensors in cleartext past
the proxy. The client's own channel decides: a TLS endpoint asks no worker for
a bulk port and opens no lane. Here the "worker" is one listening socket that
counts the connections it is offered: a TLS endpoint offers none, a plaintext
one (the control) asks it for its bulk port.
"""

from __future__ import annotations

import select
import socket

import pytest

from collectives._transport import WorkerEndpoint
from collectives.v1 import worker_pb2
from collectives.wire.security import ChannelSecurity


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def _dialled(listener: socket.socket, within_s: float) -> bool:
    ready, _, _ = select.select([listener], [], [], within_s)
    return bool(ready)


def test_a_tls_endpoint_dials_no_bulk_port_and_no_lane(listener) -> None:
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    endpoint = WorkerEndpoint.open(address, ChannelSecurity(tls=True))
    try:
        assert endpoint.bulk.port(endpoint, timeout=2.0) == 0
        request = worker_pb2.ForwardRequest(model="m", call_id="c")
        # No lane carries it (the road is then a gRPC call on the TLS channel).
        assert endpoint.lanes.send(endpoint, "Forward", request.SerializeToString(), 2.0) is None
        assert not _dialled(listener, 0.5), "a TLS client dialled the worker for raw TCP"
    finally:
        endpoint.channel.close()


def test_a_plaintext_endpoint_asks_for_the_bulk_port(listener) -> None:
    """The control: the same calls from a plaintext client reach the listener."""
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    endpoint = WorkerEndpoint.open(address)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the listener is no gRPC server
            endpoint.bulk.port(endpoint, timeout=1.0)
        assert _dialled(listener, 5.0)
    finally:
        endpoint.channel.close()
