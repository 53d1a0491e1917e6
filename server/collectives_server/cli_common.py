"""Argument types and process set-up shared by the ``collectives-server`` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys

from collectives_server.logfmt import LOG_FORMATS, JsonFormatter, text_formatter

__all__ = [
    "PARENT_PID_ENV",
    "add_log_level",
    "add_metrics",
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
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line with the op ids as fields (default: text)",
    )


def add_metrics(parser: argparse.ArgumentParser, what: str = "") -> None:
    """``--metrics-port`` (absent: no metrics endpoint) and ``--metrics-host``."""
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="P",
        help="serve Prometheus metrics at http://HOST:P/metrics"
        + (f" {what}" if what else "")
        + " (0: any free port, logged; default: no metrics endpoint)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="H",
        help="interface of the metrics endpoint (default: 127.0.0.1, this machine only)",
    )


def setup_logging(level: str, role: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if log_format == "json" else text_formatter(role))
    logging.basicConfig(level=level, handlers=[handler])


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


def add_model_hosting(parser: argparse.ArgumentParser) -> None:
    """``--allow-factory`` and ``--graph-ttl-s``: how a worker hosts models."""
    parser.add_argument(
        "--allow-factory",
        action="append",
        default=[],
        metavar="MODULE",
        help="Python module whose functions may build models for "
        "load_model(factory='MODULE:fn'); repeat or comma-separate "
        "(e.g. collectives_server.model_zoo). Default: none",
    )
    parser.add_argument(
        "--graph-ttl-s",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="drop a forward's autograd graph if no backward comes within S seconds (default: 60)",
    )


def allowed_factories(values: list[str]) -> tuple[str, ...]:
    modules = [m.strip() for value in values for m in value.split(",") if m.strip()]
    for module in modules:
        if not all(part.isidentifier() for part in module.split(".")):
            raise argparse.ArgumentTypeError(f"--allow-factory {module!r} is not a module name")
    return tuple(modules)
