"""Which local user is on the other end of a loopback gRPC connection.

Shared-memory transfers hand the worker a file path: the worker must only act
on files the *peer* could act on itself, or it becomes a confused deputy
(a user reading a root-only file through the worker, or writing into another
client's segment). The kernel knows the uid owning each
TCP socket; for a loopback connection the client's socket is the one whose
local end is the peer's address and port and whose remote end is ours.

Asked first with one netlink ``sock_diag`` request for exactly that socket (a
hash lookup in the kernel: cheap); when that finds nothing (e.g. the client
dialled another loopback address than its own), by scanning ``/proc/net/tcp``
(IPv4) and ``/proc/net/tcp6`` (IPv6, and IPv4-mapped). The scan walks the
kernel's whole TCP hash table and costs several milliseconds per call, which
was most of a small shared-memory call's time.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct

from collectives.errors import FailedPrecondition

__all__ = ["loopback_peer_uid", "parse_peer"]

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"

# netlink sock_diag (linux/sock_diag.h, linux/inet_diag.h).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_TCP_ESTABLISHED = 1
_NLMSG_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_NO_COOKIE = 0xFFFFFFFF
# inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires,
# rqueue, wqueue, then uid.
_DIAG_STATE_AT = 1
_DIAG_UID_AT = 4 + 48 + 12
_DIAG_TIMEOUT_S = 1.0


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
    host, peer_port = parsed
    uid = _sock_diag_uid(host, peer_port, server_port)
    if uid is not None:
        return uid
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


def _sock_diag_uid(host: str, peer_port: int, server_port: int) -> int | None:
    """The uid of the established socket ``host:peer_port`` → ``host:server_port``
    (a client on loopback dials the address it is bound to), asked of the kernel
    by netlink; None when not found or netlink is unavailable."""
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)
    # An IPv4 client of a dual-stack listener shows as ::ffff:a.b.c.d; its own socket is IPv4.
    candidates = [(socket.AF_INET, mapped)] if mapped is not None else []
    candidates.append((socket.AF_INET6 if address.version == 6 else socket.AF_INET, address))
    for family, ip in candidates:
        uid = _diag_lookup(family, ip.packed, peer_port, ip.packed, server_port)
        if uid is not None:
            return uid
    return None


def _diag_lookup(family: int, src: bytes, sport: int, dst: bytes, dport: int) -> int | None:
    sockid = (
        struct.pack("!HH", sport, dport)
        + src.ljust(16, b"\0")
        + dst.ljust(16, b"\0")
        + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)  # any interface, no cookie
    )
    body = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, 1 << _TCP_ESTABLISHED) + sockid
    header = _NLMSG_HEADER.pack(
        _NLMSG_HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0
    )
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(_DIAG_TIMEOUT_S)
            nl.sendto(header + body, (0, 0))
            reply = nl.recv(8192)
    except (OSError, AttributeError):  # no netlink here (or not Linux): scan /proc instead
        return None
    with contextlib.suppress(struct.error):
        _, kind, _, _, _ = _NLMSG_HEADER.unpack_from(reply)
        if kind != _SOCK_DIAG_BY_FAMILY:  # NLMSG_ERROR: ENOENT, no such socket
            return None
        message = _NLMSG_HEADER.size
        if reply[message + _DIAG_STATE_AT] != _TCP_ESTABLISHED:
            return None
        return int(struct.unpack_from("=I", reply, message + _DIAG_UID_AT)[0])
    return None
