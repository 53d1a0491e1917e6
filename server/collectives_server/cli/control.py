"""Flags of the coordinator's control-plane hardening: roles, sizes and stream caps.

``add_control_flags`` adds them to ``coordinator`` (and ``local``, which forwards
them to its coordinator with :func:`control_args`); ``control_from_args`` turns them
into :class:`~collectives_server.coordinator.daemon.CoordinatorConfig` keywords.
``add_worker_token_flag`` is the worker's ``--worker-token-file``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from collectives.wire.security import read_token_file
from collectives_server.coordinator.control import ControlLimits
from collectives_server.settings import non_negative_int, positive_float, positive_int

__all__ = [
    "add_control_flags",
    "add_worker_token_flag",
    "control_args",
    "control_from_args",
    "worker_token_from_args",
    "worker_token_path",
]

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


def add_control_flags(parser: argparse.ArgumentParser, *, local: bool = False) -> None:
    """The coordinator's roles and bounds flags (``local``: the help says what local does)."""
    add_worker_token_flag(
        parser,
        " (default: a fresh random token for this cluster's own workers)"
        if local
        else " (default: none; any caller may register)",
    )
    parser.add_argument(
        "--max-waiting-workers",
        type=non_negative_int,
        default=64,
        metavar="N",
        help="live workers beyond --max-workers that may wait for a place; more "
        "registrations answer RESOURCE_EXHAUSTED (default: 64)",
    )
    parser.add_argument(
        "--max-watch-streams",
        type=positive_int,
        default=128,
        metavar="N",
        help="WatchCluster streams open at once; more answer RESOURCE_EXHAUSTED (default: 128)",
    )
    parser.add_argument(
        "--max-watch-streams-per-peer",
        type=positive_int,
        default=32,
        metavar="N",
        help="WatchCluster streams open at once from one host (default: 32)",
    )
    parser.add_argument(
        "--dashboard-idle-s",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="close a dashboard connection idle this long, seconds (default: 10)",
    )
    parser.add_argument(
        "--dashboard-max-connections",
        type=positive_int,
        default=256,
        metavar="N",
        help="dashboard connections open at once; more get 503 (default: 256)",
    )


def control_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """CoordinatorConfig keywords from the flags of :func:`add_control_flags`."""
    return {
        "worker_token": worker_token_from_args(args, parser),
        "limits": ControlLimits(
            max_waiting_workers=args.max_waiting_workers,
            max_watch_streams=args.max_watch_streams,
            max_watch_streams_per_peer=args.max_watch_streams_per_peer,
        ),
        "dashboard_idle_s": args.dashboard_idle_s,
        "dashboard_max_connections": args.dashboard_max_connections,
    }


def control_args(args: argparse.Namespace, own_workers: int = 0) -> list[str]:
    """``local``: the coordinator's command-line flags for these settings (not the token).

    ``local``'s workers share the clients' host and each holds one WatchCluster
    stream, so the watch caps are raised by ``own_workers``: the caps bound
    what clients can open beside them.
    """
    out = [
        f"--max-waiting-workers={args.max_waiting_workers}",
        f"--max-watch-streams={args.max_watch_streams + own_workers}",
        f"--max-watch-streams-per-peer={args.max_watch_streams_per_peer + own_workers}",
        f"--dashboard-idle-s={args.dashboard_idle_s}",
        f"--dashboard-max-connections={args.dashboard_max_connections}",
    ]
    return out


def worker_token_path(args: argparse.Namespace) -> str | None:
    """``local``: the absolute path of ``--worker-token-file``, if given (checked by the caller)."""
    path = getattr(args, "worker_token_file", None)
    return os.path.abspath(path) if path else None
