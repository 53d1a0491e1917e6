"""``collectives-server coordinator``: the rendezvous and membership daemon of one cluster."""

from __future__ import annotations

import argparse
from typing import Any

from collectives_server.cli.common import (
    add_log_level,
    add_metrics,
    add_security,
    die_with_parent_if_asked,
    server_security_from_args,
    setup_logging,
)
from collectives_server.cli.control import add_control_flags, control_from_args
from collectives_server.coordinator.daemon import CoordinatorConfig
from collectives_server.settings import (
    non_negative_float,
    port_number,
    positive_float,
    positive_int,
)

__all__ = ["add_dashboard_options", "add_parser", "config_from_args", "run"]

HELP = "run the coordinator (ranks, generations, rendezvous store)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "coordinator",
        help=HELP,
        description=(
            f"{HELP.capitalize()}. Prints its address HOST:PORT as the first line of "
            "standard output; stops on SIGTERM/SIGINT with exit code 0."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=0, help="gRPC port (default: 0, any free port)"
    )
    p.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="fixed cluster size: the same as --min-workers N --max-workers N",
    )
    p.add_argument(
        "--min-workers",
        type=positive_int,
        metavar="A",
        help="seal a generation once A workers are live (default: --max-workers, else 1)",
    )
    p.add_argument(
        "--max-workers",
        type=positive_int,
        metavar="B",
        help="at most B workers per generation; extra ones wait (default: --min-workers)",
    )
    p.add_argument(
        "--heartbeat",
        "--heartbeat-s",
        dest="heartbeat_s",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="heartbeat interval told to workers, seconds (default: 1.0)",
    )
    p.add_argument(
        "--lease",
        "--lease-s",
        dest="lease_s",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="a worker silent this long is lost, seconds (default: 5.0)",
    )
    p.add_argument(
        "--join-window",
        "--join-window-s",
        dest="join_window_s",
        type=non_negative_float,
        default=0.5,
        metavar="S",
        help="wait this long after the last registration before sealing (default: 0.5)",
    )
    p.add_argument(
        "--op-timeout-s",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="collective timeout told to workers and clients, seconds (default: 30)",
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        metavar="H",
        help="host name to hand out in addresses (default: --host, or this machine's "
        "name if --host is 0.0.0.0 or ::)",
    )
    p.add_argument(
        "--store",
        type=store_url,
        default="memory",
        metavar="memory|etcd://H:P[,H:P...]",
        help="where membership lives: 'memory' (this process; the default) or an etcd "
        "cluster, where every coordinator of the same --cluster-name stands by and one "
        "leads, elected through an etcd lease (see docs/deploying.md)",
    )
    p.add_argument(
        "--cluster-name",
        default="default",
        metavar="NAME",
        help="with an etcd store: the key prefix /collectives/NAME/ this cluster's "
        "coordinators share (default: default)",
    )
    p.add_argument(
        "--leader-ttl-s",
        type=positive_int,
        default=3,
        metavar="S",
        help="with an etcd store: the leader's lease in whole seconds; a standby takes "
        "over this long after the leader dies (default: 3)",
    )
    add_dashboard_options(p)
    add_metrics(p)
    add_security(p, client_side=False)
    add_control_flags(p)
    add_log_level(p)
    p.set_defaults(run=run, parser=p)
    return p


def add_dashboard_options(p: argparse.ArgumentParser) -> None:
    """``--dashboard-port``/``--dashboard-host`` (also used by ``local``)."""
    p.add_argument(
        "--dashboard-port",
        type=port_number,
        default=None,
        metavar="P",
        help="serve the web dashboard (live workers, generation history, recent errors) "
        "on this HTTP port; 0 picks a free one (default: no dashboard)",
    )
    p.add_argument(
        "--dashboard-host",
        default="127.0.0.1",
        metavar="H",
        help="interface the dashboard binds (default: 127.0.0.1, this machine only)",
    )


def store_url(text: str) -> str:
    """``memory`` or ``etcd://HOST:PORT[,HOST:PORT...]``."""
    if text == "memory":
        return text
    from collectives_server.coordinator.ha.etcd_store import parse_etcd_url

    try:
        parse_etcd_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def config_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> CoordinatorConfig:
    """Builds the config; argument errors exit through ``parser.error`` (status 2)."""
    if args.world_size is not None:
        if args.min_workers is not None or args.max_workers is not None:
            parser.error("give either --world-size or --min-workers/--max-workers, not both")
        min_workers = max_workers = args.world_size
    elif args.min_workers is None and args.max_workers is None:
        parser.error("the cluster size is required: --world-size N, or --min-workers/--max-workers")
    else:
        max_workers = args.max_workers if args.max_workers is not None else args.min_workers
        min_workers = args.min_workers if args.min_workers is not None else 1
    try:
        return CoordinatorConfig(
            min_workers=min_workers,
            max_workers=max_workers,
            host=args.host,
            port=args.port,
            heartbeat_s=args.heartbeat_s,
            lease_s=args.lease_s,
            join_window_s=args.join_window_s,
            op_timeout_s=args.op_timeout_s,
            advertise_host=args.advertise_host,
            dashboard_port=args.dashboard_port,
            dashboard_host=args.dashboard_host,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            security=server_security_from_args(args, parser),
            store=args.store,
            cluster_name=args.cluster_name,
            leader_ttl_s=args.leader_ttl_s,
            **control_from_args(args, parser),
        )
    except ValueError as exc:
        parser.error(str(exc))


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    config = config_from_args(args, parser)
    die_with_parent_if_asked()
    setup_logging(args.log_level, "coordinator", args.log_format)
    from collectives_server.coordinator.daemon import run_coordinator

    return run_coordinator(config)
