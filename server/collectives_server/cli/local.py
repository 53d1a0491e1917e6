"""``collectives-server local``: a coordinator and N workers as child processes on loopback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from collectives_server.cli.common import (
    add_log_level,
    add_security,
    client_security_from_args,
    server_security_from_args,
    setup_logging,
)
from collectives_server.cli.control import (
    add_worker_token_flag,
    worker_token_from_args,
    worker_token_path,
)
from collectives_server.coordinator.daemon import CoordinatorConfig
from collectives_server.local import LocalCluster
from collectives_server.settings import (
    add_flags,
    flag_value,
    from_flags,
    non_negative_int,
    port_number,
    positive_int,
)
from collectives_server.signals import StopSignal
from collectives_server.worker.config import WorkerConfig

__all__ = ["add_parser", "coordinator_config_from_args", "run", "worker_config_from_args"]

HELP = "run a coordinator and N workers as child processes (the local default)"

log = logging.getLogger(__name__)

# Where local's defaults for its workers differ from a worker's own.
_LOCAL_COORDINATOR_HELP = {
    "host": "interface the coordinator and the workers bind (default: 127.0.0.1)",
    "port": "coordinator port (default: 0, any free port)",
}
_LOCAL_WORKER_HELP = {
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
        "--spares",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="start K more workers as live spares (the generation stays N): a spare takes "
        "the place of a member that dies or leaves at once, without waiting for a restart "
        "(default: 0)",
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
    p.add_argument(
        "--devices",
        default="auto",
        metavar="SPEC",
        help="'auto' (split the visible GPUs across workers if there is one per worker, "
        "else cpu), 'cpu', or a comma list split across workers (default: auto)",
    )
    add_flags(p, CoordinatorConfig, passed_on=True, help_of=_LOCAL_COORDINATOR_HELP)
    add_flags(p, WorkerConfig, passed_on=True, help_of=_LOCAL_WORKER_HELP)
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="P",
        help="serve Prometheus metrics at http://HOST:P/metrics for the coordinator, P+1 ... "
        "P+N for the workers (0: any free port each, logged; default: no metrics endpoint)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="H",
        help="interface of the metrics endpoints (default: 127.0.0.1, this machine only)",
    )
    add_security(p, client_side=True)
    add_worker_token_flag(p, " (default: a fresh random token for this cluster's own workers)")
    add_log_level(p)
    p.set_defaults(run=run, parser=p)
    return p


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if args.min_workers is not None and args.min_workers > args.workers:
        parser.error(f"--min-workers ({args.min_workers}) must be <= --workers ({args.workers})")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.metrics_port and args.metrics_port + args.workers + args.spares > 65535:
        parser.error(
            f"--metrics-port {args.metrics_port} leaves no room for "
            f"{args.workers + args.spares} workers "
            "(they use the next ports)"
        )
    try:
        coordinator = coordinator_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    coordinator_security, worker_security = _security_args(args, parser)
    worker_token_from_args(args, parser)  # an unreadable --worker-token-file exits here
    setup_logging(args.log_level, "local", args.log_format)
    with StopSignal() as stop:
        cluster = LocalCluster(
            args.workers,
            min_workers=args.min_workers,
            coordinator_config=coordinator,
            devices=args.devices,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            log_level=args.log_level,
            log_format=args.log_format,
            worker_config=worker_config_from_args(args),
            worker_args=worker_security,
            coordinator_args=coordinator_security,
            worker_token_file=worker_token_path(args),
            die_with_parent=True,
            on_exit=lambda child: stop.wake(),
            max_restarts=args.max_restarts,
            spares=args.spares,
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
    # Every child is stopped and reaped. Leave directly, as the coordinator and the
    # workers do: the threads still reading children's output and reaping them are
    # daemon threads, and an interpreter finalizing around them (and around gRPC's
    # own threads, if a worker's exit was described) is not bounded in time.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def coordinator_config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    """The local cluster's coordinator settings (its size is the launcher's to set)."""
    size = {"min_workers": args.min_workers or args.workers, "max_workers": args.workers}
    return from_flags(CoordinatorConfig, args, size)


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
