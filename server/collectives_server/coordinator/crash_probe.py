"""Whether a worker's process is gone, asked when its heartbeat stream closes.

A worker holds one ``HeartbeatStream`` to the coordinator for its whole life.
When its process ends (a crash, SIGKILL, an OOM kill) the kernel closes its
sockets: the stream ends at once, and the port its gRPC server listened on
refuses connections. The coordinator asks that port (:func:`process_gone`);
a refusal is the evidence that lets it declare the worker lost at once
instead of waiting for the lease to run out. Anything else (the port
answers, or the host does not: a partition, a frozen process, a dead machine)
proves nothing, and the lease decides as before, so a live worker whose
stream broke for another reason is never evicted by this.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

__all__ = ["PROBE_TIMEOUT_S", "process_gone"]

# How long one connection attempt may take.
PROBE_TIMEOUT_S = 0.25
# The pause between attempts while something still listens: short at first (the
# listener is closed in the same pass as the stream, a moment later on a busy
# host), then longer, for as long as the caller's patience lasts.
_FIRST_PAUSE_S = 0.005
_LONGEST_PAUSE_S = 0.1


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def process_gone(
    address: str,
    stopping: threading.Event,
    patience_s: float,
    still_suspect: Callable[[], bool] = lambda: True,
) -> bool:
    """Whether nothing listens at ``address`` (``host:port``) any more: True at the first
    connection refused there within ``patience_s``.

    While something still listens it asks again, at growing pauses. False as soon as
    ``stopping`` is set or ``still_suspect()`` is False (the worker was heard from
    again, left, or was lost), when the address cannot be parsed or reached (a
    timeout: the lease decides), or when ``patience_s`` passed with a listener there.
    """
    try:
        target = _host_port(address)
    except ValueError:
        return False
    deadline = time.monotonic() + patience_s
    pause = _FIRST_PAUSE_S
    while not stopping.is_set() and still_suspect():
        try:
            with socket.create_connection(target, timeout=PROBE_TIMEOUT_S):
                pass
        except ConnectionRefusedError:
            return True
        except OSError:
            return False  # unreachable or slow: the lease decides
        left = deadline - time.monotonic()
        if left <= 0 or stopping.wait(min(pause, left)):
            return False
        pause = min(pause * 2, _LONGEST_PAUSE_S)
    return False
