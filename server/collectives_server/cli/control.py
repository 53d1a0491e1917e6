"""The worker token flag: who may call the coordinator's worker-only RPCs.

``coordinator`` requires the token given by ``--worker-token-file``; ``worker``
sends it; ``local`` writes a fresh one for its own workers unless given one.
"""

from __future__ import annotations

import argparse
import os

from collectives.wire.security import read_token_file

__all__ = ["add_worker_token_flag", "worker_token_from_args", "worker_token_path"]

_WORKER_TOKEN_HELP = (
    "token of the worker-only coordinator RPCs (Register, Heartbeat, Leave), sent as "
    "'collectives-worker-token' metadata; the token is the file's content, stripped "
    "(keep the file mode 0600). A client token alone does not allow these RPCs"
)


def add_worker_token_flag(parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
    parser.add_argument(
        "--worker-token-file",
        default=None,
        metavar="PATH",
        help=_WORKER_TOKEN_HELP + help_suffix,
    )


def worker_token_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The worker token of ``--worker-token-file``; unreadable files exit with status 2."""
    if not getattr(args, "worker_token_file", None):
        return None
    try:
        return read_token_file(args.worker_token_file)
    except ValueError as exc:
        parser.error(f"--worker-token-file: {exc}")


def worker_token_path(args: argparse.Namespace) -> str | None:
    """``local``: the absolute path of ``--worker-token-file``, if given (checked by the caller)."""
    path = getattr(args, "worker_token_file", None)
    return os.path.abspath(path) if path else None
