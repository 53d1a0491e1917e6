"""Argument types and process set-up shared by the ``collectives-server`` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys

from collectives.wire.security import ChannelSecurity, read_pem, read_token_file
from collectives_server.logfmt import LOG_FORMATS, JsonFormatter, text_formatter
from collectives_server.security import ServerSecurity

__all__ = [
    "PARENT_PID_ENV",
    "add_log_level",
    "add_security",
    "client_security_from_args",
    "die_with_parent_if_asked",
    "server_security_from_args",
    "setup_logging",
]

# Set by the local launcher in its children's environment: the launcher's pid. A
# child seeing it asks Linux to SIGTERM it when the launcher dies (even by SIGKILL),
# so a crashed launcher leaves no orphan daemons behind.
PARENT_PID_ENV = "COLLECTIVES_PARENT_PID"

_PR_SET_PDEATHSIG = 1


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


def add_security(parser: argparse.ArgumentParser, *, client_side: bool) -> None:
    """TLS and token flags of a server; ``client_side``: also of its channel to the coordinator.

    See docs/security.md.
    """
    g = parser.add_argument_group("security (see docs/security.md)")
    g.add_argument(
        "--tls-cert",
        metavar="PATH",
        help="serve gRPC over TLS with this PEM certificate (chain); needs --tls-key",
    )
    g.add_argument("--tls-key", metavar="PATH", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca",
        metavar="PATH",
        help="mutual TLS: require client certificates signed by this PEM CA (needs --tls-cert)",
    )
    g.add_argument(
        "--token-file",
        metavar="PATH",
        help="require 'authorization: Bearer <token>' on every gRPC call but health checks; "
        "the token is the file's content, stripped (keep the file mode 0600)"
        + ("; also sent to the coordinator" if client_side else ""),
    )
    if not client_side:
        return
    g.add_argument(
        "--tls-ca",
        metavar="PATH",
        help="PEM CA that verifies the coordinator's certificate (default: the system roots); "
        "TLS to the coordinator is used when this, --tls-client-cert or --tls-cert is given",
    )
    g.add_argument(
        "--tls-client-cert",
        metavar="PATH",
        help="PEM client certificate presented to a coordinator that requires mutual TLS",
    )
    g.add_argument("--tls-client-key", metavar="PATH", help="PEM private key of --tls-client-cert")


def _token(args: argparse.Namespace) -> str | None:
    return read_token_file(args.token_file) if args.token_file else None


def server_security_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> ServerSecurity:
    """The server side of :func:`add_security`; bad files exit via ``parser.error``."""
    try:
        return ServerSecurity(
            tls_cert=read_pem(args.tls_cert, "--tls-cert") if args.tls_cert else None,
            tls_key=read_pem(args.tls_key, "--tls-key") if args.tls_key else None,
            tls_client_ca=(
                read_pem(args.tls_client_ca, "--tls-client-ca") if args.tls_client_ca else None
            ),
            token=_token(args),
        )
    except ValueError as exc:
        parser.error(str(exc))


def client_security_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> ChannelSecurity:
    """How a daemon reaches the coordinator: TLS if it serves TLS or has --tls-ca/client cert."""
    try:
        return ChannelSecurity.resolve(
            token=_token(args),
            tls=bool(args.tls_cert or args.tls_ca or args.tls_client_cert),
            tls_ca=args.tls_ca,
            tls_cert=args.tls_client_cert,
            tls_key=args.tls_client_key,
            environ={},  # daemons take flags only, not the SDK's COLLECTIVES_* variables
        )
    except ValueError as exc:
        parser.error(str(exc))
