"""The rendezvous TCPStore each worker hosts, listening only on the interface asked for.

``torch.distributed.TCPStore(is_master=True)`` binds every interface whatever host
it is given (the host only names where its own client connects), so ``local``
said it bound 127.0.0.1 while its store listened on 0.0.0.0. Here
the listening socket is made by us, bound to ``host``, and handed to the store
through ``master_listen_fd`` (torch >= 2.1, libuv backend included); the store
takes ownership of the descriptor.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

__all__ = ["listen_socket", "start_store"]

_WILDCARDS = {"", "0.0.0.0", "*"}
_BACKLOG = 1024


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one)."""
    host = host.strip("[]")
    if host in _WILDCARDS:
        infos = [(socket.AF_INET, ("0.0.0.0", port))]
    elif host == "::":
        infos = [(socket.AF_INET6, ("::", port))]
    else:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        if not found:
            raise OSError(f"store host {host!r} resolves to no address")
        infos = [(family, sockaddr) for family, _t, _p, _c, sockaddr in found]
    family, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(sockaddr)
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def start_store(host: str, port: int, timeout_s: float) -> tuple[Any, int]:
    """Starts the master TCPStore on ``host:port``; returns it and its real port."""
    from torch.distributed import TCPStore  # slow import; only daemons need it

    sock = listen_socket(host, port)
    real_port = int(sock.getsockname()[1])
    connect_host = "127.0.0.1" if sock.family == socket.AF_INET else "::1"
    if host.strip("[]") not in _WILDCARDS | {"::"}:
        connect_host = str(sock.getsockname()[0])
    try:
        store = TCPStore(
            connect_host,
            real_port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store, real_port
