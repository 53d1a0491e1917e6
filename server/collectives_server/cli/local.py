"""``collectives-server local``: a coordinator and N workers as child processes on loopback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from collectives_server.cli.common import (
    add_log_level,
    add_metrics,
    add_security,
    client_security_from_args,
    server_security_from_args,
    setup_logging,
)
from collectives_server.cli.control import (
    add_control_flags,
    control_args,
    worker_token_from_args,
    worker_token_path,
)
from collectives_server.cli.coordinator import add_dashboard_options
from collectives_server.local import LocalCluster
from collectives_server.settings import (
    add_flags,
    flag_value,
    from_flags,
    non_negative_float,
    port_number,
    positive_float,
    positive_int,
)
from collectives_server.signals import StopSignal
from collectives_server.worker.config import WorkerConfig

__all__ = ["add_parser", "run", "worker_config_from_args"]

HELP = "run a coordinator and N workers as child processes (the local default)"

log = logging.getLogger(__name__)

# Where local's defaults for its workers differ from a worker's own.
_LOCAL_HELP = {
    "model_upload.allow": "accept torch.export model archives in load_model (factories "
    "are unaffected); default: on (the local cluster binds loopback only)",
    "model_upload.load_sandbox": "first load each archive in a short-lived child with "
    "resource limits (as nobody when root); default: off",
}

# The launcher wakes at least this often to re-check its children (a safety net:
# child exits and signals wake it at once).
_SUPERVISE_WAKE_S = 30.0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "local",
        help=HELP,
        description=(
            f"{HELP.capitalize()}. Prints the coordinator address HOST:PORT as the first "
            "line of standard output as soon as it listens; children's logs go to standard "
            "error. On SIGTERM/SIGINT stops every child and exits 0."
        ),
    )
    p.add_argument(
        "--workers", type=positive_int, required=True, metavar="N", help="number of workers"
    )
    p.add_argument(
        "--min-workers",
        type=positive_int,
        default=None,
        metavar="M",
        help="keep serving while at least M workers live (default: N)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="K",
        help="restart a worker that dies, at most K times per worker, as torchrun does; it "
        "rejoins and the cluster re-forms at full size (default: 3; 0: never)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=0, help="coordinator port (default: 0, any free port)"
    )
    p.add_argument(
        "--heartbeat", "--heartbeat-s", dest="heartbeat_s", type=positive_float, default=1.0,
        metavar="S", help="heartbeat interval, seconds (default: 1.0)",
    )  # fmt: skip
    p.add_argument(
        "--lease", "--lease-s", dest="lease_s", type=positive_float, default=5.0,
        metavar="S", help="a worker silent this long is lost, seconds (default: 5.0)",
    )  # fmt: skip
    p.add_argument(
        "--join-window", "--join-window-s", dest="join_window_s", type=non_negative_float,
        default=0.5, metavar="S", help="join window before sealing, seconds (default: 0.5)",
    )  # fmt: skip
    p.add_argument(
        "--op-timeout-s", type=positive_float, default=30.0, metavar="S",
        help="collective timeout, seconds (default: 30)",
    )  # fmt: skip
    p.add_argument(
        "--devices",
        default="auto",
        metavar="SPEC",
        help="'auto' (split the visible GPUs across workers if there is one per worker, "
        "else cpu), 'cpu', or a comma list split across workers (default: auto)",
    )
    add_dashboard_options(p)
    add_flags(p, WorkerConfig, passed_on=True, help_of=_LOCAL_HELP)
    add_metrics(p, "for the coordinator, P+1 ... P+N for the workers")
    add_security(p, client_side=True)
    add_control_flags(p, local=True)
    add_log_level(p)
    p.set_defaults(run=run, parser=p)
    return p


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if args.min_workers is not None and args.min_workers > args.workers:
        parser.error(f"--min-workers ({args.min_workers}) must be <= --workers ({args.workers})")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.lease_s <= args.heartbeat_s:
        parser.error(
            f"--lease ({args.lease_s}) must be longer than --heartbeat ({args.heartbeat_s})"
        )
    if args.metrics_port and args.metrics_port + args.workers > 65535:
        parser.error(
            f"--metrics-port {args.metrics_port} leaves no room for {args.workers} workers "
            "(they use the next ports)"
        )
    coordinator_security, worker_security = _security_args(args, parser)
    worker_token_from_args(args, parser)  # an unreadable --worker-token-file exits here
    setup_logging(args.log_level, "local", args.log_format)
    with StopSignal() as stop:
        cluster = LocalCluster(
            args.workers,
            min_workers=args.min_workers,
            host=args.host,
            port=args.port,
            heartbeat_s=args.heartbeat_s,
            lease_s=args.lease_s,
            join_window_s=args.join_window_s,
            op_timeout_s=args.op_timeout_s,
            devices=args.devices,
            dashboard_port=args.dashboard_port,
            dashboard_host=args.dashboard_host,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            log_level=args.log_level,
            log_format=args.log_format,
            worker_config=worker_config_from_args(args),
            worker_args=worker_security,
            coordinator_args=coordinator_security + control_args(args, own_workers=args.workers),
            worker_token_file=worker_token_path(args),
            die_with_parent=True,
            on_exit=lambda child: stop.wake(),
            max_restarts=args.max_restarts,
        )
        try:
            cluster.start()
        except (RuntimeError, ValueError, OSError) as exc:
            log.error("could not start the local cluster: %s", exc)
            return 1
        code = 0
        try:
            sys.stdout.write(f"{cluster.address}\n")
            sys.stdout.flush()
            while not stop.wait(_SUPERVISE_WAKE_S):
                coordinator = cluster.coordinator
                if coordinator is not None and coordinator.exited.is_set():
                    log.error(
                        "the coordinator %s; stopping the workers", coordinator.describe_exit()
                    )
                    code = 1
                    break
            if stop.stopping:
                log.info("signal %d: stopping the local cluster", stop.received or 0)
        finally:
            cluster.stop()
    return code


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """What every worker of the local cluster is started with (its address, devices and
    ports are the launcher's to set): archive uploads on and the load sandbox off unless
    the flags say otherwise."""
    given: dict[str, object] = {"coordinator": ""}
    if flag_value(args, "model_upload.allow") is None:
        given["model_upload.allow"] = True
    if flag_value(args, "model_upload.load_sandbox") is None:
        given["model_upload.load_sandbox"] = False
    return from_flags(WorkerConfig, args, given)


def _security_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[list[str], list[str]]:
    """The TLS/token flags of the coordinator and of each worker (paths, made absolute).

    Checked here first (unreadable files exit with status 2). With
    ``--tls-client-ca`` and no ``--tls-client-cert``, the workers present the
    server certificate to the coordinator (it must then allow client auth).
    """
    server_security_from_args(args, parser)
    if args.tls_client_ca and not args.tls_client_cert:
        args.tls_client_cert, args.tls_client_key = args.tls_cert, args.tls_key
    client_security_from_args(args, parser)

    def flags(names: tuple[str, ...]) -> list[str]:
        out = []
        for name in names:
            value = getattr(args, name)
            if value:
                out.append(f"--{name.replace('_', '-')}={os.path.abspath(value)}")
        return out

    server = flags(("tls_cert", "tls_key", "tls_client_ca", "token_file"))
    return server, server + flags(("tls_ca", "tls_client_cert", "tls_client_key"))
