"""Flags for the bounds on what a client can make a worker hold.

``--max-groups`` caps the sub-groups (``new_group``) of one generation: each
gloo group costs every member ~5 file descriptors and ~3 threads, so an
unbounded count lets any client exhaust a worker. Beyond the cap ``new_group``
answers RESOURCE_EXHAUSTED; a generation's groups are freed when it ends.
``local`` forwards the flag to its workers.
"""

from __future__ import annotations

import argparse
from typing import Any

from collectives_server.cli.common import positive_int

__all__ = ["DEFAULT_MAX_GROUPS", "add_group_flags", "groups_from_args", "group_worker_args"]

DEFAULT_MAX_GROUPS = 64


def add_group_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-groups",
        type=positive_int,
        default=DEFAULT_MAX_GROUPS,
        metavar="N",
        help="sub-groups (new_group) one generation may hold; beyond it new_group answers "
        f"RESOURCE_EXHAUSTED (default: {DEFAULT_MAX_GROUPS})",
    )


def groups_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The WorkerConfig fields these flags set."""
    return {"max_groups": args.max_groups}


def group_worker_args(args: argparse.Namespace) -> list[str]:
    """What ``local`` passes on to each worker."""
    return [f"--max-groups={args.max_groups}"]
