"""The uid behind a loopback connection: netlink's exact lookup agrees with /proc."""

from __future__ import annotations

import os
import socket

import pytest

from collectives.errors import FailedPrecondition
from collectives_server.worker.transport import peer_identity

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")


def _connected(family: int, host: str):
    server = socket.socket(family)
    server.bind((host, 0))
    server.listen()
    client = socket.create_connection(server.getsockname()[:2], timeout=10)
    accepted, _ = server.accept()
    return server, client, accepted


@pytest.mark.parametrize("family,host,peer", [
    (socket.AF_INET, "127.0.0.1", "ipv4:127.0.0.1:{}"),
    (socket.AF_INET6, "::1", "ipv6:[::1]:{}"),
])  # fmt: skip
def test_the_uid_is_found_by_netlink_and_by_the_proc_scan(family, host, peer) -> None:
    try:
        server, client, accepted = _connected(family, host)
    except OSError as err:
        pytest.skip(f"no {host} here: {err}")
    with server, client, accepted:
        peer_port, server_port = client.getsockname()[1], server.getsockname()[1]
        uid = peer_identity.loopback_peer_uid(peer.format(peer_port), server_port)
        assert uid == os.geteuid()
        by_netlink = peer_identity._sock_diag_uid(host, peer_port, server_port)
        assert by_netlink in (None, uid)  # None: a kernel without sock_diag
        # The server's own end (local port = server_port) is never taken for the client's.
        assert peer_identity._sock_diag_uid(host, server_port, peer_port) in (None, uid)


def test_a_closed_connection_is_not_found() -> None:
    server, client, accepted = _connected(socket.AF_INET, "127.0.0.1")
    peer_port, server_port = client.getsockname()[1], server.getsockname()[1]
    for s in (client, accepted, server):
        s.close()
    assert peer_identity._sock_diag_uid("127.0.0.1", peer_port, server_port) is None
    with pytest.raises(FailedPrecondition, match="could not be established"):
        peer_identity.loopback_peer_uid(f"ipv4:127.0.0.1:{peer_port}", server_port)
