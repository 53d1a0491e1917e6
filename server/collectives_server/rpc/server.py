"""gRPC server construction shared by the coordinator and the workers.

Every server also serves ``grpc.health.v1`` (so load balancers and
``grpc_health_probe`` work) and server reflection (so ``grpcurl`` can list and
call it without the protos), and allows messages of one data chunk plus framing.

:class:`~collectives_server.security.ServerSecurity` adds TLS (``--tls-cert/--tls-key``), mutual TLS
(``--tls-client-ca``) and a bearer token (``--token-file``): with a token,
every call except the health service's must carry ``authorization: Bearer
<token>`` or is refused with UNAUTHENTICATED before any servicer code runs
(see ``docs/security.md``). Every servicer sits behind
:class:`~collectives_server.rpc.errors.ErrorBoundary`: undecodable requests are
INVALID_ARGUMENT, unexpected exceptions INTERNAL with only an id (details in the log).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from collectives.wire.limits import MAX_MESSAGE_BYTES
from collectives_server.rpc.errors import ErrorBoundary
from collectives_server.rpc.health import HealthService
from collectives_server.rpc.limits import DataPlaneLimits, RpcLimits, pool_size
from collectives_server.security import ServerSecurity, TokenAuthInterceptor

__all__ = [
    "GRPC_OPTIONS",
    "SMALL_MESSAGE_OPTIONS",
    "WORKER_OPTIONS",
    "ServerHandle",
    "ServerSecurity",
    "start_server",
]

GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

# For a server that receives small messages only (the coordinator). HTTP/2 BDP
# probing grows flow-control windows for bulk transfers by sending a PING when data
# arrives; on many mostly idle connections that is one PING (and its ACK) per
# heartbeat, doubling the coordinator's wakeups and CPU per message (figures in
# docs/perf-log.md).
SMALL_MESSAGE_OPTIONS: list[tuple[str, int]] = [("grpc.http2.bdp_probe", 0)]

# For a worker: bulk bytes take the bulk port, and what still streams over gRPC
# (--no-bulk, TLS, model archives) is written out as each message arrives. With
# BDP probing on, a stream's window grew with the handler's own stalls (a slow
# disk write read as a long RTT): the transport then buffered tens of MiB ahead
# of a LoadModel handler. Off, a streamed put keeps its speed and a small
# all_reduce saves one PING round trip per call (figures in docs/perf-log.md).
# Without BDP the receive window stays at HTTP/2's 64 KiB, so a request past it
# (a forward's inline shard) waited mid-message for a WINDOW_UPDATE, a round trip
# that on busy cores waits for the peer's poller: a fixed 1 MiB lookahead covers
# the inline budget of a forward and still bounds what a stream buffers ahead.
WORKER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 1 << 20),
]


class ServerHandle:
    """A started server: its bound port, health servicer, and a way to stop it."""

    def __init__(
        self,
        server: grpc.Server,
        port: int,
        health_servicer: HealthService,
        limits: DataPlaneLimits | None = None,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
    ):
        self.server = server
        self.port = port
        self.health = health_servicer
        self.limits = limits
        # The server's interceptors, outermost first: what every call passes through
        # (the worker's call lanes wrap their handlers in the same list).
        self.interceptors = tuple(interceptors)

    def set_serving(self, service: str, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set(service, status)

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait(grace_s + 1.0)
        if self.limits is not None:
            self.limits.close()


def start_server(
    host: str,
    port: int,
    register: Sequence[Callable[[grpc.Server], None]],
    service_names: Sequence[str],
    max_workers: int = 32,
    security: ServerSecurity | None = None,
    options: Sequence[tuple[str, int]] = (),
    limits: RpcLimits | None = None,
) -> ServerHandle:
    """Starts a server on ``host:port`` (port 0 picks a free one) and returns its handle.

    ``register`` adds the servicers; ``service_names`` are their full names
    (``collectives.v1.Worker``) for health and reflection. ``security`` (default:
    plaintext, no token) chooses TLS, mutual TLS and the bearer token. ``options``
    are channel arguments added to :data:`GRPC_OPTIONS` (e.g. the coordinator's
    :data:`SMALL_MESSAGE_OPTIONS`). ``limits`` (the workers') bounds the calls of
    the worker service in number, idle time and duration, and sizes the thread
    pool so they cannot take every thread (:mod:`collectives_server.rpc.limits`).
    """
    security = security or ServerSecurity()
    interceptors: list[grpc.ServerInterceptor] = (
        [TokenAuthInterceptor(security.token)] if security.token else []
    )
    data_plane = DataPlaneLimits(limits) if limits is not None else None
    if data_plane is not None:
        interceptors.append(data_plane)
        max_workers = pool_size(limits)
    # Innermost: a call refused by authentication is never parsed.
    interceptors.append(ErrorBoundary())
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=[*GRPC_OPTIONS, *options],
        interceptors=interceptors,
    )
    for add in register:
        add(server)
    health_servicer = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    credentials = security.credentials()
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # grpc's "Failed to bind to address ..."
        bound = 0
    if bound == 0:
        raise OSError(
            f"cannot listen on {host}:{port}: the port is in use, or the address is not "
            "one of this host's"
        )
    server.start()
    for name in service_names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return ServerHandle(server, bound, health_servicer, data_plane, interceptors)
