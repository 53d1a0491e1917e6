"""A TLS client dials only a TLS bulk port; a plaintext client only a plaintext one.

The bulk port and the call lanes on it are raw TCP. A worker under TLS serves
them over TLS with its gRPC port's credentials and says so
(``DataPlaneResponse.bulk_tls``); a plaintext worker behind a TLS proxy on the
same host offers a plaintext port, and a TLS client that took it would send
calls and tensors in cleartext past the proxy. The client's own channel
decides: here the "worker" is one listening socket that records what it is sent,
and its data-plane answer is given by a stub of the gRPC call.
"""

from __future__ import annotations

import select
import socket
import ssl
from dataclasses import dataclass, field

import pytest

from collectives.transport.bulk import BulkPort
from collectives.transport.lanes import CallLanes
from collectives.v1 import worker_pb2
from collectives.wire.raw_tls import client_context
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


@dataclass
class _Stub:
    """The worker's ``GetDataPlane`` answer."""

    answer: worker_pb2.DataPlaneResponse

    def GetDataPlane(self, request, timeout):  # noqa: N802 - the gRPC method's name
        answer = worker_pb2.DataPlaneResponse()
        answer.CopyFrom(self.answer)
        if request.open_lane:
            answer.lane_ticket = bytes(16)
        return answer


@dataclass
class _Endpoint:
    address: str
    stub: _Stub
    bulk: BulkPort
    lanes: CallLanes = field(default_factory=CallLanes)


def _endpoint(listener: socket.socket, *, client_tls: bool, port_tls: bool) -> _Endpoint:
    port = listener.getsockname()[1]
    context = client_context(ChannelSecurity(tls=True)) if client_tls else None
    answer = worker_pb2.DataPlaneResponse(bulk_port=port, bulk_tls=port_tls)
    return _Endpoint(f"127.0.0.1:{port}", _Stub(answer), BulkPort(context))


@pytest.mark.parametrize(
    ("client_tls", "port_tls"), [(True, False), (False, True)], ids=["tls-client", "plain-client"]
)
def test_a_bulk_port_of_the_other_kind_is_never_dialled(listener, client_tls, port_tls) -> None:
    endpoint = _endpoint(listener, client_tls=client_tls, port_tls=port_tls)
    assert endpoint.bulk.port(endpoint, timeout=2.0) == 0
    request = worker_pb2.ForwardRequest(model="m", call_id="c").SerializeToString()
    # No lane carries it (the road is then a gRPC call on the client's channel).
    assert endpoint.lanes.send(endpoint, "Forward", request, 2.0) is None
    assert not _dialled(listener, 0.5), "a client dialled a bulk port of the other kind"


def test_a_tls_client_dials_a_tls_port_through_tls(listener) -> None:
    endpoint = _endpoint(listener, client_tls=True, port_tls=True)
    port = endpoint.bulk.port(endpoint, timeout=2.0)
    assert port == listener.getsockname()[1]
    # The listener speaks no TLS: the handshake fails, but its first bytes were a TLS
    # ClientHello, not a prelude in cleartext.
    with pytest.raises(OSError):
        endpoint.bulk.dial("127.0.0.1", port, timeout=2.0)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(5)
        first = conn.recv(3)
    assert first[:1] == b"\x16" and first[1:2] == b"\x03", first  # handshake record, TLS


def test_a_plaintext_client_dials_a_plaintext_port_in_the_clear(listener) -> None:
    endpoint = _endpoint(listener, client_tls=False, port_tls=False)
    port = endpoint.bulk.port(endpoint, timeout=2.0)
    sock = endpoint.bulk.dial("127.0.0.1", port, timeout=2.0)
    with sock:
        assert not isinstance(sock, ssl.SSLSocket)
        assert _dialled(listener, 5.0)
