"""Channels, deadlines and unary calls: the torch-free part of the transport.

The CLI (``collectives status``/``top``) and the connection setup need only
these, so they live apart from :mod:`collectives.transport.endpoints` (which imports
torch for the data plane) and a ``collectives --help`` starts in a fraction of
a second.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from collectives._deadlines import timeout_left
from collectives.errors import Unavailable, channel_was_closed, closed_handle
from collectives.errors import from_rpc_error as _from_rpc_error
from collectives.wire.limits import MAX_MESSAGE_BYTES
from collectives.wire.security import PLAINTEXT, ChannelSecurity

__all__ = [
    "CHANNEL_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "CLIENT_NAME_ENV",
    "call_unary",
    "channel_options",
    "deadline_s",
    "open_channel",
    "wait_channel_ready",
]

R = TypeVar("R")

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


# A client's name for operators (the workers' client lists and error rows), sent
# in the gRPC user agent as "collectives-client/<name>".
CLIENT_NAME_ENV = "COLLECTIVES_CLIENT_NAME"
_USER_AGENT_PREFIX = "collectives-client/"
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._:@-]")
_NAME_MAX = 64


def channel_options(client_name: str | None = None) -> list[tuple[str, Any]]:
    """:data:`CHANNEL_OPTIONS`, with the client's name (``client_name``, else
    ``COLLECTIVES_CLIENT_NAME`` if set) in the primary user agent; characters
    outside ``[A-Za-z0-9._:@-]`` become ``_``, and the name is cut to 64 characters."""
    given = client_name if client_name is not None else os.environ.get(CLIENT_NAME_ENV, "")
    name = _NAME_CHARS.sub("_", given.strip())[:_NAME_MAX]
    if not name:
        return list(CHANNEL_OPTIONS)
    return [*CHANNEL_OPTIONS, ("grpc.primary_user_agent", _USER_AGENT_PREFIX + name)]


def open_channel(
    address: str, security: ChannelSecurity = PLAINTEXT, client_name: str | None = None
) -> grpc.Channel:
    """A channel to ``address`` with the SDK's message size limits (and the client's
    name in its user agent, see :func:`channel_options`).

    ``security`` chooses TLS and the bearer token (default: plaintext, no token).
    """
    return security.open_channel(address, channel_options(client_name))


def wait_channel_ready(
    channel: grpc.Channel, address: str, timeout: float, budget: str = ""
) -> None:
    """Blocks until ``channel`` is connected.

    ``budget`` names the caller's whole time budget for the message (e.g. "2 s,
    the timeout given to connect()"); by default, ``timeout`` itself.

    Raises:
        Unavailable: nothing answered at ``address`` within ``timeout`` seconds.
    """
    try:
        grpc.channel_ready_future(channel).result(timeout=max(timeout, 0.0))
    except grpc.FutureTimeoutError:
        raise Unavailable(
            f"nothing answers at {address}: could not connect within "
            f"{budget or f'{timeout:.3g} s'} "
            "(is the coordinator running, is the address host:port, and do the TLS "
            "settings match the server's: plaintext vs TLS, the CA, a client certificate?)"
        ) from None


def call_unary(
    method: Callable[..., R], request: Any, timeout: float, what: str, **kwargs: Any
) -> R:
    """Calls a unary-unary multi-callable with a deadline, converting errors.

    Raises:
        CollectiveError: the call failed (subclass by status code).
    """
    try:
        return method(request, timeout=deadline_s(timeout, what), **kwargs)
    except grpc.RpcError as err:
        raise _from_rpc_error(err, what) from None
    except ValueError as err:
        if not channel_was_closed(err):
            raise
        raise closed_handle(what) from None  # close() from another thread


def deadline_s(timeout: float, what: str) -> float:
    """The remaining seconds as a gRPC timeout; no time left is DEADLINE_EXCEEDED."""
    return timeout_left(timeout, what)
