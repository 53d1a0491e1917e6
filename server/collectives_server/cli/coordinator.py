"""``collectives-server coordinator``: the rendezvous and membership daemon of one cluster."""

from __future__ import annotations

import argparse
from typing import Any

from collectives_server.cli.common import (
    add_log_level,
    add_security,
    die_with_parent_if_asked,
    server_security_from_args,
    setup_logging,
)
from collectives_server.cli.control import add_worker_token_flag, worker_token_from_args
from collectives_server.coordinator.daemon import CoordinatorConfig
from collectives_server.settings import add_flags, from_flags, positive_int

__all__ = ["add_parser", "config_from_args", "run"]

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
    add_flags(p, CoordinatorConfig)
    add_security(p, client_side=False)
    add_worker_token_flag(p, " (default: none; any caller may register)")
    add_log_level(p)
    p.set_defaults(run=run, parser=p)
    return p


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
    given = {
        "min_workers": min_workers,
        "max_workers": max_workers,
        "security": server_security_from_args(args, parser),
        "worker_token": worker_token_from_args(args, parser),
    }
    try:
        return from_flags(CoordinatorConfig, args, given)
    except ValueError as exc:
        parser.error(str(exc))


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    config = config_from_args(args, parser)
    die_with_parent_if_asked()
    setup_logging(args.log_level, "coordinator", args.log_format)
    from collectives_server.coordinator.daemon import run_coordinator

    return run_coordinator(config)
