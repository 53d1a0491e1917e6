"""The coordinator daemon: gRPC server and lease ticker in one object.

:class:`Coordinator` owns the moving parts: the ``collectives.v1.Coordinator``
gRPC server (with health and reflection, via :func:`collectives_server.rpc.server.start_server`)
and a ticker thread that applies lease expiry and the join window even when no RPC
arrives. The rendezvous TCPStore a generation's process groups meet in is not
here: every worker hosts one, and a generation meets in its rank 0's
(``cluster_message.rendezvous_address``). Tests and
the local launcher start it in-process on port 0 and read :attr:`Coordinator.address`;
:func:`run_coordinator` is the ``collectives-server coordinator`` entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives_server import gc_tuning as heap
from collectives_server.coordinator.control import ControlGuard, ControlLimits
from collectives_server.coordinator.dashboard.server import DashboardServer
from collectives_server.coordinator.drain_rules import PREPARE_MAX_S
from collectives_server.coordinator.ha.etcd_replication import EtcdReplication
from collectives_server.coordinator.ha.etcd_store import (
    EtcdLeadership,
    StoreUnavailableError,
    parse_etcd_url,
)
from collectives_server.coordinator.membership import Membership
from collectives_server.coordinator.metrics import coordinator_registry
from collectives_server.coordinator.service import SERVICE_NAME, CoordinatorServicer
from collectives_server.hosts import dialled_name
from collectives_server.metrics import MetricsServer
from collectives_server.rpc.server import SMALL_MESSAGE_OPTIONS, ServerHandle, start_server
from collectives_server.security import ServerSecurity
from collectives_server.settings import (
    metrics_host_setting,
    metrics_port_setting,
    non_negative_float,
    port_number,
    positive_float,
    positive_int,
    setting,
)
from collectives_server.signals import StopSignal

__all__ = ["Coordinator", "CoordinatorConfig", "format_address", "run_coordinator"]

log = logging.getLogger(__name__)

# gRPC threads: WatchCluster streams may hold up to --max-watch-streams of them; these
# stay free for Register/Heartbeat. Each HeartbeatStream holds one more (see
# heartbeat_stream_limit); the pool starts its threads only as calls need them.
_FREE_GRPC_THREADS = 32
# Heartbeat streams beyond one per worker: a worker re-registering opens its new
# stream while the coordinator may not have seen the old one end yet.
_HEARTBEAT_STREAM_HEADROOM = 32


def store_url(text: str) -> str:
    """``memory`` or ``etcd://HOST:PORT[,HOST:PORT...]``."""
    if text == "memory":
        return text
    try:
        parse_etcd_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def heartbeat_stream_limit(max_workers: int) -> int:
    """How many HeartbeatStream calls may be open (beyond: unary Heartbeat)."""
    return max_workers + _HEARTBEAT_STREAM_HEADROOM


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """Everything ``collectives-server coordinator`` takes; units in the names."""

    # The cluster's size bounds (the CLI's --world-size, --min-workers, --max-workers).
    min_workers: int
    max_workers: int
    host: str = setting("127.0.0.1", flag="--host", help="interface to bind")
    port: int = setting(
        0,
        flag="--port",
        parse=port_number,
        shown_default="0, any free port",
        help="gRPC port",
    )
    # A worker silent for lease_s is LOST.
    heartbeat_s: float = setting(
        1.0,
        flag=("--heartbeat", "--heartbeat-s"),
        parse=positive_float,
        metavar="S",
        help="heartbeat interval told to workers, seconds",
    )
    lease_s: float = setting(
        5.0,
        flag=("--lease", "--lease-s"),
        parse=positive_float,
        metavar="S",
        help="a worker silent this long is lost, seconds",
    )
    join_window_s: float = setting(
        0.5,
        flag=("--join-window", "--join-window-s"),
        parse=non_negative_float,
        metavar="S",
        help="wait this long after the last registration before sealing, seconds",
    )
    drain_prepare_s: float = setting(
        PREPARE_MAX_S,
        flag="--drain-prepare-s",
        parse=non_negative_float,
        metavar="S",
        help="a drain forms the next generation's groups and copies ahead, while the current "
        "one serves, for at most this long (and half the drain's timeout) before it seals; "
        "0: seal at once, the groups formed and the tensors copied after the seal",
    )
    op_timeout_s: float = setting(
        30.0,
        flag="--op-timeout-s",
        parse=positive_float,
        metavar="S",
        help="collective timeout told to workers and clients, seconds",
    )
    advertise_host: str | None = setting(
        None,
        flag="--advertise-host",
        metavar="H",
        passed_on=False,
        shown_default="--host, or this machine's name if --host is 0.0.0.0 or ::",
        help="host name to hand out in addresses",
    )
    dashboard_port: int | None = setting(
        None,
        flag="--dashboard-port",
        parse=port_number,
        metavar="P",
        shown_default="no dashboard",
        help="serve the web dashboard (live workers, generation history, recent errors) "
        "on this HTTP port; 0 picks a free one",
    )
    dashboard_host: str = setting(
        "127.0.0.1",
        flag="--dashboard-host",
        metavar="H",
        shown_default="127.0.0.1, this machine only",
        help="interface the dashboard binds",
    )
    metrics_port: int | None = metrics_port_setting()
    metrics_host: str = metrics_host_setting()
    # TLS / mutual TLS / bearer token of the gRPC server (default: plaintext, open).
    security: ServerSecurity = field(default_factory=ServerSecurity)
    # Token the worker-only RPCs (Register, Heartbeat, Leave) require; None: none.
    worker_token: str | None = None
    # Waiting workers, watch streams, Cluster message budget.
    limits: ControlLimits = field(default_factory=ControlLimits)
    dashboard_idle_s: float = setting(
        10.0,
        flag="--dashboard-idle-s",
        parse=positive_float,
        metavar="S",
        help="close a dashboard connection idle this long, seconds",
    )
    dashboard_max_connections: int = setting(
        256,
        flag="--dashboard-max-connections",
        parse=positive_int,
        metavar="N",
        help="dashboard connections open at once; more get 503",
    )
    store: str = setting(
        "memory",
        flag="--store",
        parse=store_url,
        metavar="memory|etcd://H:P[,H:P...]",
        passed_on=False,
        shown_default="memory",
        help="where membership lives: 'memory' (this process) or an etcd cluster, where "
        "every coordinator of the same --cluster-name stands by and one leads, elected "
        "through an etcd lease (see docs/deploying.md)",
    )
    cluster_name: str = setting(
        "default",
        flag="--cluster-name",
        metavar="NAME",
        passed_on=False,
        help="with an etcd store: the key prefix /collectives/NAME/ this cluster's "
        "coordinators share",
    )
    # A standby takes over this long after the leader dies (plus a poll).
    leader_ttl_s: int = setting(
        3,
        flag="--leader-ttl-s",
        parse=positive_int,
        metavar="S",
        passed_on=False,
        help="with an etcd store: the leader's lease in whole seconds; a standby takes "
        "over this long after the leader dies",
    )

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"max_workers ({self.max_workers}) must be >= min_workers ({self.min_workers})"
            )
        for name in ("heartbeat_s", "lease_s", "op_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.join_window_s < 0:
            raise ValueError(f"join_window_s must be >= 0, got {self.join_window_s}")
        if self.lease_s <= self.heartbeat_s:
            raise ValueError(
                f"lease_s ({self.lease_s}) must be longer than heartbeat_s ({self.heartbeat_s}), "
                "or every worker would be declared lost between two heartbeats"
            )
        if self.dashboard_idle_s <= 0 or self.dashboard_max_connections < 1:
            raise ValueError(
                "dashboard_idle_s must be > 0 and dashboard_max_connections >= 1, got "
                f"{self.dashboard_idle_s}, {self.dashboard_max_connections}"
            )
        if self.store != "memory":
            parse_etcd_url(self.store)  # raises ValueError with the reason
        if not self.cluster_name or "/" in self.cluster_name or len(self.cluster_name) > 128:
            raise ValueError(
                f"cluster_name must be 1..128 characters without '/': {self.cluster_name!r}"
            )
        if self.leader_ttl_s < 1:
            raise ValueError(f"leader_ttl_s must be >= 1 second, got {self.leader_ttl_s}")
        for name in ("port", "dashboard_port", "metrics_port"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")

    @property
    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return dialled_name(self.host)


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around a bare IPv6 host."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class Coordinator:
    """A running coordinator. ``start()`` binds; ``stop()`` is idempotent.

    ``clock`` (monotonic seconds) is injectable for tests that control time.
    """

    def __init__(
        self, config: CoordinatorConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._server: ServerHandle | None = None
        self._servicer: CoordinatorServicer | None = None
        self._stop_ticker = threading.Event()
        self._ticker: threading.Thread | None = None
        self._dashboard: DashboardServer | None = None
        self._metrics: MetricsServer | None = None
        self._replication: EtcdReplication | None = None

    def _replication_for(
        self, cfg: CoordinatorConfig, membership: Membership
    ) -> EtcdReplication | None:
        """The HA link for an etcd store (None for memory); it campaigns once started."""
        if cfg.store == "memory":
            return None

        def new_membership() -> Membership:
            return Membership(
                cfg.min_workers,
                cfg.max_workers,
                lease_s=cfg.lease_s,
                join_window_s=cfg.join_window_s,
                id_prefix=membership._id_prefix,
                pause_s=membership.pause_s,
                prepare_s=cfg.drain_prepare_s,
            )

        leadership = EtcdLeadership(cfg.store, cfg.cluster_name, "", ttl_s=cfg.leader_ttl_s)
        self._replication = EtcdReplication(leadership, new_membership, self._clock)
        return self._replication

    # ---- lifecycle -------------------------------------------------------------

    def start(self) -> Coordinator:
        if self._server is not None:
            raise RuntimeError("coordinator already started")
        cfg = self.config
        membership = Membership(
            cfg.min_workers,
            cfg.max_workers,
            lease_s=cfg.lease_s,
            join_window_s=cfg.join_window_s,
            id_prefix=f"w{secrets.token_hex(3)}",
            # Microseconds since the epoch: above every version a previous coordinator
            # at this address handed out, so watchers re-opening with their last one
            # still receive the new state (see Membership).
            initial_version=time.time_ns() // 1000,
            pause_s=_pause_s(cfg),
            prepare_s=cfg.drain_prepare_s,
        )
        replication = self._replication_for(cfg, membership)
        self._servicer = CoordinatorServicer(
            membership,
            heartbeat_s=cfg.heartbeat_s,
            op_timeout_s=cfg.op_timeout_s,
            clock=self._clock,
            guard=ControlGuard(cfg.limits, cfg.worker_token),
            max_heartbeat_streams=heartbeat_stream_limit(cfg.max_workers),
            replication=replication,
        )
        servicer = self._servicer
        self._server = start_server(
            cfg.host,
            cfg.port,
            register=[
                lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s)
            ],
            service_names=[SERVICE_NAME],
            max_workers=_FREE_GRPC_THREADS
            + cfg.limits.max_watch_streams
            + heartbeat_stream_limit(cfg.max_workers),
            security=cfg.security,
            options=SMALL_MESSAGE_OPTIONS,
        )
        servicer.set_identity(self.address)
        if replication is not None:
            replication.leadership.identity = self.address
            replication.leadership.on_change = servicer.on_leadership
            replication.leadership.on_state = servicer.on_state
            replication.leadership.on_reach = servicer.on_reach
            try:
                replication.leadership.start()
            except StoreUnavailableError as exc:
                self.stop()
                raise OSError(f"store {cfg.store}: {exc}") from exc
        if cfg.dashboard_port is not None:
            try:
                self._dashboard = DashboardServer(
                    servicer,
                    host=cfg.dashboard_host,
                    port=cfg.dashboard_port,
                    idle_s=cfg.dashboard_idle_s,
                    max_connections=cfg.dashboard_max_connections,
                    withhold_details=cfg.security.token is not None,
                ).start()
            except OSError as exc:
                self.stop()
                where = f"{cfg.dashboard_host}:{cfg.dashboard_port}"
                raise OSError(f"dashboard on {where}: {exc}") from exc
        if cfg.metrics_port is not None:
            try:
                registry = coordinator_registry(servicer, self._dashboard)
                self._metrics = MetricsServer(
                    registry, cfg.metrics_host, cfg.metrics_port, "coordinator"
                )
            except OSError as exc:
                self.stop()
                raise OSError(f"metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc}") from exc
        interval = _tick_interval_s(cfg)
        self._ticker = threading.Thread(
            target=self._tick_loop, args=(interval,), name="coordinator-ticker", daemon=True
        )
        self._ticker.start()
        log.info(
            "coordinator listening on %s (membership in %s, min %d, max %d, heartbeat %gs, "
            "lease %gs)",
            self.address,
            cfg.store,
            cfg.min_workers,
            cfg.max_workers,
            cfg.heartbeat_s,
            cfg.lease_s,
        )
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        """Ends watch streams, stops the dashboard, the server, the ticker and the store.

        A leader of an HA set resigns first, so a standby takes over at once."""
        if self._replication is not None:
            self._replication.leadership.stop(resign=True)
            self._replication.close()
            self._replication = None
        if self._dashboard is not None:
            self._dashboard.stop()
            self._dashboard = None
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
        if self._servicer is not None:
            self._servicer.close()
        if self._server is not None:
            self._server.stop(grace_s)
            self._server = None
        self._stop_ticker.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5.0)
            self._ticker = None

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _tick_loop(self, interval_s: float) -> None:
        while not self._stop_ticker.wait(interval_s):
            if self._servicer is None:
                continue
            try:
                self._servicer.tick()
            except Exception:  # a bug here must not silently stop lease expiry
                log.exception("coordinator tick failed")

    # ---- addresses and state ---------------------------------------------------

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("coordinator not started")
        return self._server.port

    @property
    def address(self) -> str:
        """``host:port`` of the gRPC server, as clients and workers should dial it."""
        return format_address(self.config.advertised_host, self.port)

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of the Prometheus endpoint; None when it is off."""
        return self._metrics.address if self._metrics is not None else None

    @property
    def dashboard_address(self) -> str | None:
        """``host:port`` of the web dashboard; None when it is off."""
        return self._dashboard.address if self._dashboard is not None else None

    def cluster(self) -> coordinator_pb2.Cluster:
        """The current Cluster message, as GetCluster would answer."""
        if self._servicer is None:
            raise RuntimeError("coordinator not started")
        return self._servicer.snapshot()


def run_coordinator(config: CoordinatorConfig) -> int:
    """Runs a coordinator until SIGTERM/SIGINT; returns the exit code if it could not
    start, else leaves the process with exit code 0 once stopped.

    The first line of standard output is the address ``HOST:PORT``; logs go to stderr.
    """
    with StopSignal() as stop:
        coordinator = Coordinator(config)
        try:
            coordinator.start()
        except (OSError, RuntimeError) as exc:
            log.error(
                "could not start the coordinator on %s:%d: %s",
                config.host,
                config.port,
                exc,
            )
            return 1
        try:
            sys.stdout.write(f"{coordinator.address}\n")
            sys.stdout.flush()
            heap.settle()
            while not stop.wait(timeout_s=60.0):
                pass
            log.info("signal %d: stopping the coordinator", stop.received or 0)
        finally:
            coordinator.stop()
    # Stopped, flushed and closed: leave directly, as the worker does. Forked from
    # the preloaded zygote (`local`), this process holds torch's heap, and finalizing
    # the interpreter around it took seconds on a loaded machine.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tick_interval_s(cfg: CoordinatorConfig) -> float:
    """How often the ticker applies the passage of time (lease expiry, the join window)."""
    return max(0.01, min(cfg.heartbeat_s / 2, 0.25, cfg.join_window_s / 2 or 0.25))


def _pause_s(cfg: CoordinatorConfig) -> float:
    """The gap between two decisions that only a pause of the coordinator's own explains:
    its ticker decides every :func:`_tick_interval_s`; a third of the lease, and never
    less than four ticks."""
    return max(cfg.lease_s / 3, 4 * _tick_interval_s(cfg))
