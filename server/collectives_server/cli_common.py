"""Argument types and process set-up shared by the ``collectives-server`` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys

__all__ = [
    "PARENT_PID_ENV",
    "add_log_level",
    "die_with_parent_if_asked",
    "host_port",
    "non_negative_float",
    "port_number",
    "positive_float",
    "positive_int",
    "setup_logging",
]

# Set by the local launcher in its children's environment: the launcher's pid. A
# child seeing it asks Linux to SIGTERM it when the launcher dies (even by SIGKILL),
# so a crashed launcher leaves no orphan daemons behind.
PARENT_PID_ENV = "COLLECTIVES_PARENT_PID"

_PR_SET_PDEATHSIG = 1


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(
            f"must be a port in 0..65535 (0: any free port), got {text}"
        )
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:50051), got {text!r}")
    return text


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging threshold; logs go to stderr (default: INFO)",
    )


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s",
    )


def die_with_parent_if_asked() -> None:
    """Arranges SIGTERM on the launcher's death when :data:`PARENT_PID_ENV` is set (Linux)."""
    expected = os.environ.pop(PARENT_PID_ENV, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(expected):  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
