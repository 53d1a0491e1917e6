"""Which local user is on the other end of a loopback gRPC connection.

Shared-memory transfers hand the worker a file path: the worker must only act
on files the *peer* could act on itself, or it becomes a confused deputy
(issue 16, H4/H5: a user reading a root-only file through the worker, or
writing into another client's segment). The kernel knows the uid owning each
TCP socket; for a loopback connection the client's socket is the one whose
local end is the peer's port and whose remote end is ours, in
``/proc/net/tcp`` (IPv4) or ``/proc/net/tcp6`` (IPv6, and IPv4-mapped).
"""

from __future__ import annotations

import ipaddress

from collectives.errors import FailedPrecondition

__all__ = ["loopback_peer_uid", "parse_peer"]

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"


def parse_peer(peer: str) -> tuple[str, int] | None:
    """``ipv4:127.0.0.1:5000`` → ("127.0.0.1", 5000); None for anything else."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host, _, port = rest.rpartition(":")
    elif kind == "ipv6" and rest.startswith("["):
        host, _, port = rest[1:].partition("]:")
    else:
        return None
    if not port.isdigit():
        return None
    return host, int(port)


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def loopback_peer_uid(peer: str, server_port: int) -> int:
    """The uid owning the client's socket of the connection ``peer`` → our ``server_port``.

    Raises:
        FailedPrecondition: the peer is not on loopback, or its socket is not
            found (the client then uses the gRPC stream instead).
    """
    parsed = parse_peer(peer)
    if parsed is None or not _is_loopback(parsed[0]):
        raise FailedPrecondition(
            f"shared-memory transfers need a client on the worker's host over loopback; "
            f"the peer is {peer!r}: use PutTensor/GetTensor"
        )
    peer_port = parsed[1]
    for table in _TABLES:
        try:
            with open(table) as f:
                next(f, None)  # the header
                for line in f:
                    uid = _match(line.split(), peer_port, server_port)
                    if uid is not None:
                        return uid
        except OSError:
            continue
    raise FailedPrecondition(
        f"shared memory refused: the owner of the client's connection {peer!r} could not be "
        "established; use PutTensor/GetTensor"
    )


def _loopback_hex(host: str) -> bool:
    """A /proc/net/tcp{,6} address (host byte order, hex) on loopback."""
    host = host.upper()
    if len(host) == 8:
        return host.endswith("7F")  # 127.x.x.x
    return host == "00000000000000000000000001000000" or (
        host.startswith("0000000000000000FFFF0000") and host.endswith("7F")
    )


def _match(fields: list[str], peer_port: int, server_port: int) -> int | None:
    # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
    if len(fields) < 8 or fields[3] != _ESTABLISHED:
        return None
    local_host, _, local_hex = fields[1].rpartition(":")
    if not _loopback_hex(local_host):
        return None
    local_port = int(local_hex, 16)
    remote_port = int(fields[2].rpartition(":")[2], 16)
    if local_port == peer_port and remote_port == server_port:
        return int(fields[7])
    return None
