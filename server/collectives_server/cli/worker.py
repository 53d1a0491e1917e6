"""``collectives-server worker``: one worker daemon, registered with a coordinator."""

from __future__ import annotations

import argparse
from typing import Any

from collectives_server.cli.archive import add_archive_flags, archive_from_args
from collectives_server.cli.common import (
    add_log_level,
    add_max_tensor_bytes,
    add_metrics,
    add_model_hosting,
    add_security,
    allowed_factories,
    client_security_from_args,
    die_with_parent_if_asked,
    host_ports,
    port_number,
    positive_float,
    positive_int,
    server_security_from_args,
    setup_logging,
)
from collectives_server.cli.control import (
    add_worker_token_flag,
    non_negative_int,
    worker_token_from_args,
)
from collectives_server.cli.data_plane import add_data_plane_flags, data_plane_from_args
from collectives_server.cli.groups import add_group_flags, groups_from_args
from collectives_server.worker.config import WorkerConfig
from collectives_server.worker.transport.lanes import LANE_METHODS

__all__ = ["add_parser", "config_from_args", "parse_devices", "run"]

HELP = "run a worker (joins the coordinator's process group, executes collectives)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "worker",
        help=HELP,
        description=(
            f"{HELP.capitalize()}. Prints its address HOST:PORT as the first line of "
            "standard output; stops on SIGTERM/SIGINT."
        ),
    )
    p.add_argument(
        "--coordinator",
        required=True,
        type=host_ports,
        metavar="H:P[,H:P...]",
        help="coordinator address, or every address of an HA set (h1:p1,h2:p2,h3:p3): "
        "the worker talks to the first that answers and moves on when it goes away",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=0, help="gRPC port (default: 0, any free port)"
    )
    p.add_argument(
        "--devices",
        type=parse_devices,
        default=(),
        metavar="LIST",
        help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu "
        "(default: every visible CUDA device, else cpu)",
    )
    p.add_argument(
        "--op-timeout-s",
        type=positive_float,
        default=None,
        metavar="S",
        help="collective timeout, seconds (default: the coordinator's --op-timeout-s)",
    )
    p.add_argument(
        "--queue-size",
        type=positive_int,
        default=1024,
        metavar="N",
        help="bound of the leader's op queue; beyond it RESOURCE_EXHAUSTED (default: 1024)",
    )
    p.add_argument(
        "--flight-recorder-ops",
        type=non_negative_int,
        default=2000,
        metavar="N",
        help="ops the flight recorder keeps, each with its phase times (collectives trace, "
        "collectives diagnose); 0 turns it off (default: 2000)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="how long to keep trying to reach the coordinator at start-up (default: 60)",
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        metavar="H",
        help="host name clients and peers use to reach this worker "
        "(default: --host, or the machine's name when --host is a wildcard)",
    )
    p.add_argument(
        "--advertise-port",
        type=port_number,
        default=None,
        metavar="P",
        help="port clients and peers use to reach this worker, when it differs from --port "
        "(a NAT or container port mapping; default: the bound port)",
    )
    p.add_argument(
        "--bulk-port",
        type=port_number,
        default=0,
        metavar="P",
        help="TCP port of the bulk data plane: large put/get payloads go over raw TCP, "
        "authorised by one-time tickets sent over gRPC; over TLS with the gRPC port's "
        "certificate when TLS is on (default: 0, any free port)",
    )
    p.add_argument(
        "--no-bulk",
        action="store_true",
        help="no bulk port: every payload goes through gRPC streams",
    )
    p.add_argument(
        "--no-call-lanes",
        action="store_true",
        help="serve no call lanes on the bulk port: every forward is a gRPC call "
        "(with --no-bulk there are none anyway)",
    )
    p.add_argument(
        "--lane-methods",
        type=_lane_methods,
        default=None,
        metavar="NAMES",
        help="comma-separated Worker methods the call lanes carry; the others are gRPC "
        f"calls (default: every one a lane can carry: {','.join(LANE_METHODS)})",
    )
    add_max_tensor_bytes(p)
    add_group_flags(p)
    add_data_plane_flags(p)
    add_model_hosting(p)
    add_archive_flags(p)
    add_metrics(p)
    add_security(p, client_side=True)
    add_worker_token_flag(p)
    add_log_level(p)
    p.set_defaults(run=run, parser=p)
    return p


def parse_devices(text: str) -> tuple[str, ...]:
    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    for d in devices:
        kind, _, index = d.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise argparse.ArgumentTypeError(f"unknown device {d!r}; use cpu or cuda:N")
    return devices


def _lane_methods(text: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in LANE_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: not a method a call lane carries "
            f"(one of {', '.join(LANE_METHODS)})"
        )
    return methods


def config_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> WorkerConfig:
    parser = parser or getattr(args, "parser", None) or argparse.ArgumentParser()
    return WorkerConfig(
        coordinator=args.coordinator,
        host=args.host,
        port=args.port,
        devices=args.devices,
        op_timeout_s=args.op_timeout_s,
        queue_size=args.queue_size,
        flight_recorder_ops=args.flight_recorder_ops,
        max_tensor_bytes=args.max_tensor_bytes,
        connect_timeout_s=args.connect_timeout_s,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        advertise_host=args.advertise_host,
        advertise_port=args.advertise_port,
        allow_factories=allowed_factories(args.allow_factory),
        graph_ttl_s=args.graph_ttl_s,
        factory_batching=args.factory_batching,
        bulk_port=None if args.no_bulk else args.bulk_port,
        call_lanes=not args.no_call_lanes,
        lane_methods=args.lane_methods,
        security=server_security_from_args(args, parser),
        coordinator_security=client_security_from_args(args, parser),
        worker_token=worker_token_from_args(args, parser),
        **groups_from_args(args),
        **data_plane_from_args(args),
        model_upload=archive_from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    die_with_parent_if_asked()
    setup_logging(args.log_level, "worker", args.log_format)
    # Imported here: the worker daemon pulls in torch and is only needed by this command.
    from collectives_server.worker.daemon import run_worker

    return int(run_worker(config))
