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

__all__ = ["PROBE_ATTEMPTS", "PROBE_TIMEOUT_S", "process_gone"]

# Connection attempts, and how long each may take. A process is torn down by the
# kernel in one pass, so its listening socket is normally closed before its stream
# is; the later attempts cover a listener closed just after.
PROBE_ATTEMPTS = 3
PROBE_TIMEOUT_S = 0.25


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def process_gone(address: str, stopping: threading.Event) -> bool:
    """Whether nothing listens at ``address`` (``host:port``) any more: a connection
    refused there within :data:`PROBE_ATTEMPTS` tries. False as soon as ``stopping``
    is set, or when the address cannot be parsed or reached."""
    try:
        target = _host_port(address)
    except ValueError:
        return False
    for _ in range(PROBE_ATTEMPTS):
        if stopping.is_set():
            return False
        try:
            with socket.create_connection(target, timeout=PROBE_TIMEOUT_S):
                pass
        except ConnectionRefusedError:
            return True
        except OSError:
            return False  # unreachable or slow: the lease decides
        # Something still listens: give a listener being torn down a moment.
        if stopping.wait(PROBE_TIMEOUT_S):
            return False
    return False
