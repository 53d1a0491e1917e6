"""Channels, deadlines and unary calls: the torch-free part of the transport.

The CLI (``collectives status``/``top``) and the connection setup need only
these, so they live apart from :mod:`collectives._transport` (which imports
torch for the data plane) and a ``collectives --help`` starts in a fraction of
a second.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from collectives._deadlines import timeout_left
from collectives.errors import Unavailable
from collectives.errors import from_rpc_error as _from_rpc_error
from collectives.wire.limits import MAX_MESSAGE_BYTES
from collectives.wire.security import PLAINTEXT, ChannelSecurity

__all__ = [
    "CHANNEL_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "call_unary",
    "deadline_s",
    "open_channel",
    "wait_channel_ready",
]

R = TypeVar("R")

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def open_channel(address: str, security: ChannelSecurity = PLAINTEXT) -> grpc.Channel:
    """A channel to ``address`` with the SDK's message size limits.

    ``security`` chooses TLS and the bearer token (default: plaintext, no token).
    """
    return security.open_channel(address, CHANNEL_OPTIONS)


def wait_channel_ready(channel: grpc.Channel, address: str, timeout: float) -> None:
    """Blocks until ``channel`` is connected.

    Raises:
        Unavailable: nothing answered at ``address`` within ``timeout`` seconds.
    """
    try:
        grpc.channel_ready_future(channel).result(timeout=max(timeout, 0.0))
    except grpc.FutureTimeoutError:
        raise Unavailable(
            f"nothing answers at {address}: could not connect within {timeout:.3g} s "
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


def deadline_s(timeout: float, what: str) -> float:
    """The remaining seconds as a gRPC timeout; no time left is DEADLINE_EXCEEDED."""
    return timeout_left(timeout, what)
