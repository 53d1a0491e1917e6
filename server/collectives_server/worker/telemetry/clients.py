"""The clients that called this worker recently: peer, user agent, the name they gave.

Every RPC's guard notes its caller (:meth:`ClientTable.seen`): a dictionary
lookup by the gRPC peer string, and the call's metadata is read only for a
peer not seen before, so the data path pays next to nothing. A client names
itself with ``COLLECTIVES_CLIENT_NAME``, which the SDK appends to its gRPC
user agent as ``collectives-client/<name>``; that token is parsed here.
gRPC does not tell a server when a client disconnects, so "connected" means
"called within :data:`CONNECTED_WITHIN_S`". At most :data:`MAX_CLIENTS` peers
are kept; a new one evicts the peer seen least recently.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from collectives.v1 import status_pb2

__all__ = [
    "CONNECTED_WITHIN_S",
    "MAX_CLIENTS",
    "NAME_TOKEN",
    "ClientTable",
    "client_name",
    "short_user_agent",
]

MAX_CLIENTS = 16
CONNECTED_WITHIN_S = 60.0
# The user-agent token carrying the client's name: "collectives-client/<name>".
NAME_TOKEN = "collectives-client/"
_NAME = re.compile(re.escape(NAME_TOKEN) + r"([A-Za-z0-9._:@-]{1,64})")
_USER_AGENT_CHARS = 64
# gRPC's C core appends its own version and transport: the same for every client.
_CORE_SUFFIX = re.compile(r"\s*grpc-c/.*$")


def client_name(user_agent: str) -> str:
    """The name a client gave in its user agent ("" when none)."""
    match = _NAME.search(user_agent)
    return match.group(1) if match else ""


def short_user_agent(user_agent: str) -> str:
    """The user agent as reported: without the name token (reported apart) and gRPC's
    C-core suffix, at most 64 characters (a status rides in every Cluster message)."""
    agent = _CORE_SUFFIX.sub("", _NAME.sub("", user_agent)).strip()
    return agent[:_USER_AGENT_CHARS]


@dataclass
class _Client:
    peer: str
    user_agent: str
    name: str
    first_unix_s: float
    last_unix_s: float

    @property
    def label(self) -> str:
        return f"{self.name} ({self.peer})" if self.name else self.peer


class ClientTable:
    """The recent callers, by peer; thread-safe."""

    def __init__(self, limit: int = MAX_CLIENTS) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._clients: dict[str, _Client] = {}  # least recently seen first

    def seen(self, peer: str, metadata: Callable[[], Iterable[tuple[str, object]]]) -> str:
        """Notes a call from ``peer`` (``metadata`` is read for a new peer only);
        returns the client's label ("name (peer)" or the peer)."""
        now = time.time()
        with self._lock:
            client = self._clients.pop(peer, None)
            if client is None:
                agent = ""
                for key, value in metadata() or ():
                    if key == "user-agent":
                        agent = str(value)[:1024]
                client = _Client(peer, short_user_agent(agent), client_name(agent), now, now)
                while len(self._clients) >= self._limit:
                    del self._clients[next(iter(self._clients))]
            self._clients[peer] = client
            client.last_unix_s = now
            return client.label

    def to_proto(self) -> list[status_pb2.ClientStatus]:
        """The clients seen within :data:`CONNECTED_WITHIN_S`, most recent first."""
        since = time.time() - CONNECTED_WITHIN_S
        with self._lock:
            recent = [c for c in reversed(self._clients.values()) if c.last_unix_s >= since]
            return [
                status_pb2.ClientStatus(
                    peer=c.peer,
                    user_agent=c.user_agent,
                    name=c.name,
                    last_unix_time_s=c.last_unix_s,
                )
                for c in recent
            ]
