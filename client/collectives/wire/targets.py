"""A gRPC channel target for one coordinator address, or for several.

``host:port`` is used as it is (gRPC's DNS resolver re-resolves it, and moves to
another of a name's addresses when one goes away: a Kubernetes Service name over
every coordinator works so). A list ``h1:p1,h2:p2,h3:p3`` becomes one ``ipv4:``
(or ``ipv6:``) target of every address the hosts resolve to, and gRPC's
``round_robin`` policy then spreads calls over those that answer: any coordinator
of an HA set answers reads and passes writes to the leader, and one that cannot
answer (it lost etcd, so its view may be stale) refuses with UNAVAILABLE, which
the caller's retry sends to the next one.
"""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["channel_target", "split_addresses"]


def split_addresses(address: str) -> list[str]:
    """``"h1:p1, h2:p2"`` -> ``["h1:p1", "h2:p2"]`` (empty items dropped)."""
    return [part.strip() for part in address.split(",") if part.strip()]


def _host_port(address: str) -> tuple[str, int]:
    if address.startswith("["):
        host, _, port = address[1:].partition("]:")
    else:
        host, _, port = address.rpartition(":")
    return host, int(port)


def channel_target(address: str, *, tls: bool = False) -> tuple[str, list[tuple[str, Any]]]:
    """The target to dial for ``address`` and the channel options it needs.

    Raises:
        OSError: a list whose hosts resolve to no address at all.
    """
    parts = split_addresses(address)
    if len(parts) <= 1:
        return address.strip(), []
    v4: list[str] = []
    v6: list[str] = []
    unresolved: list[str] = []
    for part in parts:
        host, port = _host_port(part)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            unresolved.append(part)  # perhaps not up yet: the others may be
            continue
        for family, _t, _p, _c, sockaddr in infos:
            if family == socket.AF_INET and f"{sockaddr[0]}:{port}" not in v4:
                v4.append(f"{sockaddr[0]}:{port}")
            elif family == socket.AF_INET6 and f"[{sockaddr[0]}]:{port}" not in v6:
                v6.append(f"[{sockaddr[0]}]:{port}")
    if not v4 and not v6:
        raise OSError(f"no coordinator address of {address!r} resolves ({', '.join(unresolved)})")
    target = "ipv4:" + ",".join(v4) if v4 else "ipv6:" + ",".join(v6)
    first_host = _host_port(parts[0])[0]
    # Headers and the TLS name check use the first name given, not an IP address.
    options: list[tuple[str, Any]] = [
        ("grpc.default_authority", parts[0]),
        ("grpc.lb_policy_name", "round_robin"),
    ]
    if tls:
        options.append(("grpc.ssl_target_name_override", first_host))
    return target, options
