"""``collectives-server``: one entry point, one module per subcommand (``cmd_*.py``).

``coordinator`` runs the rendezvous daemon, ``worker`` one worker daemon, and
``local`` a coordinator plus N workers as child processes on loopback. Every
daemon prints its address ``HOST:PORT`` as the first line of standard output and
logs to standard error.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from collectives_server import __version__
from collectives_server.cli import coordinator as cmd_coordinator
from collectives_server.cli import local as cmd_local
from collectives_server.cli import worker as cmd_worker

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collectives-server",
        description="Daemons of the collectives service (torch.distributed collectives over gRPC).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmd_coordinator.add_parser(sub)
    cmd_worker.add_parser(sub)
    cmd_local.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args))
