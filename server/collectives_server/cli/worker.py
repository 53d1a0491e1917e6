"""``collectives-server worker``: one worker daemon, registered with a coordinator."""

from __future__ import annotations

import argparse
from typing import Any

from collectives_server.cli.common import (
    add_log_level,
    add_security,
    client_security_from_args,
    die_with_parent_if_asked,
    server_security_from_args,
    setup_logging,
)
from collectives_server.cli.control import add_worker_token_flag, worker_token_from_args
from collectives_server.settings import add_flags, flag_value, from_flags
from collectives_server.worker.config import WorkerConfig

__all__ = ["add_parser", "config_from_args", "run"]

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
    add_flags(p, WorkerConfig)
    add_security(p, client_side=True)
    add_worker_token_flag(p)
    add_log_level(p)
    p.set_defaults(run=run, parser=p)
    return p


def config_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> WorkerConfig:
    """The worker's config; unreadable security files exit through ``parser.error``.

    Archive uploads are off by default unless the worker requires a token."""
    parser = parser or getattr(args, "parser", None) or argparse.ArgumentParser()
    given: dict[str, Any] = {
        "security": server_security_from_args(args, parser),
        "coordinator_security": client_security_from_args(args, parser),
        "worker_token": worker_token_from_args(args, parser),
    }
    if flag_value(args, "model_upload.allow") is None:
        given["model_upload.allow"] = bool(args.token_file)
    return from_flags(WorkerConfig, args, given)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    die_with_parent_if_asked()
    setup_logging(args.log_level, "worker", args.log_format)
    # Imported here: the worker daemon pulls in torch and is only needed by this command.
    from collectives_server.worker.daemon import run_worker

    return int(run_worker(config))
