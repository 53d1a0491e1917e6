"""Which listening hosts mean "every interface", and the name peers dial then.

A daemon bound to a wildcard host (``0.0.0.0``, ``::``) cannot tell peers that
address: the coordinator, the workers' gRPC address, their gloo device and
their control channel all advertise this machine's name instead, as gloo's
default device does.
"""

from __future__ import annotations

import socket

__all__ = ["WILDCARD_HOSTS", "is_wildcard", "dialled_name"]

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def is_wildcard(host: str | None) -> bool:
    """Whether ``host`` (None: not set) listens on every interface."""
    return host is None or host in WILDCARD_HOSTS


def dialled_name(host: str | None) -> str:
    """The name peers dial to reach a daemon listening on ``host``."""
    return socket.gethostname() if is_wildcard(host) else host  # type: ignore[return-value]
