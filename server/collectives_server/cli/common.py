"""Argument types and process set-up shared by the ``collectives-server`` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys

from collectives.errors import InvalidArgument
from collectives.wire.batching import Batching
from collectives.wire.security import ChannelSecurity, read_pem, read_token_file
from collectives_server.logfmt import LOG_FORMATS, JsonFormatter, text_formatter
from collectives_server.security import ServerSecurity

__all__ = [
    "PARENT_PID_ENV",
    "add_log_level",
    "add_metrics",
    "add_security",
    "client_security_from_args",
    "die_with_parent_if_asked",
    "host_port",
    "host_ports",
    "non_negative_float",
    "port_number",
    "positive_float",
    "positive_int",
    "server_security_from_args",
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


def host_ports(text: str) -> str:
    """``HOST:PORT`` or a comma-separated list of them (an HA coordinator set)."""
    parts = [part.strip() for part in text.split(",")]
    for part in parts:
        host_port(part)
    return ",".join(parts)


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
    """``--allow-factory``, ``--graph-ttl-s`` and ``--factory-batching``: how a worker
    hosts models."""
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
    parser.add_argument(
        "--factory-batching",
        type=factory_batching,
        default=None,
        metavar="ROWS[:MS]",
        help="merge concurrent no-grad forwards of models built by a factory (whose "
        "load_model names no batching) into one forward of up to ROWS rows, waiting at most "
        "MS milliseconds for company (e.g. 256:2). Default: no batching",
    )


def factory_batching(text: str) -> Batching:
    """``--factory-batching ROWS[:MS]`` as a policy."""
    try:
        return Batching.parse(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip


def byte_size(text: str) -> int:
    """``1048576``, ``64MiB``, ``2G`` ... → a positive number of bytes."""
    stripped = text.strip().lower().replace("_", "")
    digits = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(digits) :]
    try:
        value = float(digits) * _BYTE_UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a unit (e.g. 1048576, 512MiB, 2GiB)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {text}")
    return int(value)


def add_max_tensor_bytes(parser: argparse.ArgumentParser) -> None:
    """``--max-tensor-bytes``: the quota of each worker's tensor store."""
    parser.add_argument(
        "--max-tensor-bytes",
        type=byte_size,
        default=None,
        metavar="N",
        help="quota of each worker's tensor store (bytes, or e.g. 512MiB, 2GiB); puts and "
        "collective results beyond it answer RESOURCE_EXHAUSTED (default: unbounded)",
    )


def allowed_factories(values: list[str]) -> tuple[str, ...]:
    modules = [m.strip() for value in values for m in value.split(",") if m.strip()]
    for module in modules:
        if not all(part.isidentifier() for part in module.split(".")):
            raise argparse.ArgumentTypeError(f"--allow-factory {module!r} is not a module name")
    return tuple(modules)


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
