"""The ``collectives`` command: a look at a running cluster from the client side.

``collectives status --coordinator H:P`` asks the coordinator once
(``GetCluster``, with a deadline) and prints the membership as an aligned
table, or as one JSON object with ``--json`` for scripts and dashboards. It
does not wait for the cluster to form: a cluster that is still gathering
workers is shown as it is. Exit codes: 0 shown, 2 the coordinator could not be
reached (or a usage error), so scripts can tell "down" from "not formed".

``--watch`` keeps going: it follows ``WatchCluster`` and redraws the table on
every change (with ``--json``: prints one JSON object per line per change)
until Ctrl-C or SIGTERM, then exits 0. A lost coordinator is retried.

``collectives top`` is a live view: every ``--interval`` seconds one row per
worker with its state, ops per second (from consecutive snapshots), queue
depth, memory and tensors held.

Piped into a reader that stops early (``collectives status --watch | head -n
3``), every command exits 0 without a word on stderr once the reader is gone:
a long-running one notices at once, even with nothing more to write.

``collectives trace`` and ``collectives diagnose`` read every rank's flight
record (``cli.flight``): a Chrome trace of the recent ops, and the ops that
are stuck with the ranks they wait on (exit 1 when one is).

``collectives drain WORKER`` and ``collectives rollout`` replace workers
(``cli.drains``): one member's rank handed to a spare, or every member's in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TextIO

import grpc

from collectives.addresses import (
    REFUSED_GRACE_S,
    coordinator_from_environment,
    not_a_coordinator,
    other_protocol,
    parse_addresses,
    refused_within,
)
from collectives.cli.drains import add_drain_commands, run_drain, run_rollout
from collectives.cli.flight import add_flight_commands, run_diagnose, run_trace
from collectives.errors import CollectiveError, InvalidArgument
from collectives.observe.status_tables import (
    WIDE,
    format_table,
    format_top,
    rates_between,
    terminal_width,
)
from collectives.transport.channels import call_unary, open_channel
from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc
from collectives.wire.cluster_state import ClusterSnapshot
from collectives.wire.security import PLAINTEXT, ChannelSecurity, read_token_file

__all__ = ["fetch_status", "format_table", "format_top", "main"]

EXIT_OK = 0
EXIT_UNREACHABLE = 2
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT

# Clear the screen and move the cursor home (ANSI), before each redraw.
CLEAR = "\x1b[H\x1b[2J"
# Re-opening a broken watch: first wait, and the longest.
_RETRY_MIN_S = 0.5
_RETRY_MAX_S = 5.0
# How often the main thread looks at its stop flag, and how long it waits for the body.
_SIGNAL_POLL_S = 0.1
_STOP_JOIN_S = 2.0


def _add_coordinator(command: argparse.ArgumentParser) -> None:
    """``--coordinator``, or ``COLLECTIVES_COORDINATOR`` when the flag is not given."""
    from_env = coordinator_from_environment()
    command.add_argument(
        "--coordinator",
        required=from_env is None,
        default=from_env,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the coordinator(s) (default: $COLLECTIVES_COORDINATOR)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collectives", description="Client-side tools for a collectives cluster."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = commands.add_parser(
        "status", help="show the cluster's generation and workers, as the coordinator sees them"
    )
    _add_coordinator(status)
    status.add_argument("--json", action="store_true", help="print one JSON object instead")
    status.add_argument(
        "--wide", action="store_true", help="every column, however wide the terminal"
    )
    status.add_argument(
        "--watch",
        action="store_true",
        help="redraw on every change until Ctrl-C/SIGTERM (with --json: one object per line)",
    )
    status.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="deadline for reaching the coordinator (default 5)",
    )
    top = commands.add_parser("top", help="live per-worker view: ops/s, queue, memory, tensors")
    _add_coordinator(top)
    top.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="refresh (default 1)"
    )
    top.add_argument(
        "--iterations", type=int, default=0, metavar="N", help="stop after N frames (default: run)"
    )
    top.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="deadline per call"
    )
    top.add_argument("--wide", action="store_true", help="every column, however wide the terminal")
    flight = add_flight_commands(commands)
    replacing = add_drain_commands(commands)
    for command in (*flight, *replacing):
        _add_coordinator(command)
    for command in (status, top, *flight, *replacing):
        _add_security(command)
    return parser


def _add_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (default: the COLLECTIVES_* variables, as the SDK)")
    g.add_argument(
        "--token-file", metavar="PATH", help="send the bearer token stored in PATH (stripped)"
    )
    g.add_argument("--tls", action="store_true", help="use TLS (implied by --tls-ca/--tls-cert)")
    g.add_argument("--tls-ca", metavar="PATH", help="PEM CA verifying the server (default: system)")
    g.add_argument("--tls-cert", metavar="PATH", help="PEM client certificate (mutual TLS)")
    g.add_argument("--tls-key", metavar="PATH", help="PEM key of --tls-cert")


def _security(args: argparse.Namespace) -> ChannelSecurity:
    """Flags first, then COLLECTIVES_TOKEN/COLLECTIVES_TLS_* (as ``collectives.connect``)."""
    return ChannelSecurity.resolve(
        token=read_token_file(args.token_file) if args.token_file else None,
        tls=True if args.tls else None,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


# ------------------------------------------------------------------ formatting


def fetch_status(
    address: str, timeout: float, security: ChannelSecurity = PLAINTEXT
) -> ClusterSnapshot:
    """One ``GetCluster`` call to the coordinator at ``address``.

    Raises:
        CollectiveError: no answer within ``timeout`` seconds (``UNAVAILABLE`` or
            ``DEADLINE_EXCEEDED``), or the token was refused (``UNAUTHENTICATED``).
    """
    channel = open_channel(address, security)
    try:
        return _get_cluster(channel, address, timeout)
    finally:
        channel.close()


def _get_cluster(channel: grpc.Channel, address: str, timeout: float) -> ClusterSnapshot:
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    # wait_for_ready: keep trying to connect until the deadline rather than
    # failing on the first refused connection (the coordinator may be starting).
    try:
        msg = call_unary(
            stub.GetCluster,
            coordinator_pb2.GetClusterRequest(),
            timeout,
            f"GetCluster from {address}",
            wait_for_ready=True,
        )
    except CollectiveError as err:
        if err.code == grpc.StatusCode.UNIMPLEMENTED:
            raise InvalidArgument(not_a_coordinator(channel, address, timeout)) from None
        raise
    return ClusterSnapshot.from_proto(msg)


def _json_line(address: str, snapshot: ClusterSnapshot, indent: int | None = None) -> str:
    return json.dumps({"coordinator": address, **snapshot.to_dict()}, indent=indent)


# ----------------------------------------------------------- stopping cleanly


class _Session:
    """A long-running command's stop flag and the channels to close when it is set.

    The command's body runs on a worker thread; the main thread only waits on
    :attr:`stop`, so Ctrl-C and SIGTERM are handled at once wherever the body
    is blocked (a gRPC stream, a sleep), and closing the channels ends it.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._channels: list[grpc.Channel] = []

    def open_channel(self, address: str, security: ChannelSecurity) -> grpc.Channel:
        channel = open_channel(address, security)
        with self._lock:
            self._channels.append(channel)
        return channel

    def close(self) -> None:
        self.stop.set()
        with self._lock:
            channels, self._channels = self._channels, []
        for channel in channels:
            channel.close()


def _reader_gone(stream: TextIO) -> bool:
    """Whether ``stream`` is a pipe whose reading end is closed (``| head`` exited):
    poll reports an error on the writing end then, before anything is written."""
    if not hasattr(select, "poll"):
        return False  # Windows: the next write says so (BrokenPipeError)
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # errors and hang-ups are always reported
    try:
        events = poller.poll(0)
    except OSError:
        return False
    return any(mask & select.POLLERR for _, mask in events)


def _silence_stdout() -> None:
    """Points stdout at /dev/null, so the interpreter's last flush of what the gone
    reader never took does not print "Exception ignored ... BrokenPipeError"."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def _until_stopped(body: Callable[[_Session], int]) -> int:
    """Runs ``body``; SIGTERM, Ctrl-C or the reader of stdout going away end it with
    exit code 0."""
    session = _Session()
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["code"] = body(session)
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc
        finally:
            session.stop.set()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        session.stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    worker = threading.Thread(target=run, name="collectives-cli", daemon=True)
    reader_gone = False
    try:
        worker.start()
        # A wait with a timeout, so the signal handlers run promptly, and a closed
        # pipe is noticed while the body has nothing to write.
        while not session.stop.wait(_SIGNAL_POLL_S):
            if _reader_gone(sys.stdout):
                reader_gone = True
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        session.close()
    worker.join(_STOP_JOIN_S)  # before main() points stdout elsewhere
    if reader_gone:
        raise BrokenPipeError(f"the reader of {sys.stdout.name} is gone")  # main(): quiet
    if worker.is_alive() or ("code" not in outcome and "error" not in outcome):
        return EXIT_OK  # stopped by a signal
    error = outcome.get("error")
    if isinstance(error, BaseException):
        if isinstance(error, BrokenPipeError):
            raise error  # main() ends quietly
        if session.stop.is_set() and isinstance(error, (grpc.RpcError, CollectiveError)):
            return EXIT_OK  # the channel was closed under it by the stop
        raise error
    return int(outcome["code"])  # type: ignore[call-overload]


# ---------------------------------------------------------------- commands


def _width(args: argparse.Namespace) -> int:
    return WIDE if args.wide else terminal_width()


def _check_timeout(command: str, timeout: float) -> bool:
    if timeout > 0:
        return True
    print(f"collectives {command}: --timeout must be positive", file=sys.stderr)
    return False


def _unreachable(command: str, address: str, timeout: float, err: CollectiveError) -> int:
    if isinstance(err, InvalidArgument):  # something else answers there
        print(f"collectives {command}: {err.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(
        f"collectives {command}: cannot reach the coordinator at {address} "
        f"within {timeout:g} s (--timeout): {err}",
        file=sys.stderr,
    )
    return EXIT_UNREACHABLE


def _status(args: argparse.Namespace) -> int:
    if not _check_timeout("status", args.timeout):
        return EXIT_UNREACHABLE
    if args.watch:
        return _until_stopped(lambda session: _watch(args, session))
    try:
        snapshot = fetch_status(args.coordinator, args.timeout, args.security)
    except CollectiveError as err:
        return _unreachable("status", args.coordinator, args.timeout, err)
    if args.json:
        print(_json_line(args.coordinator, snapshot, indent=2))
    else:
        print(format_table(args.coordinator, snapshot, _width(args)))
    return EXIT_OK


def _changes(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    address: str,
    after_version: int,
    stop: threading.Event,
) -> Iterator[ClusterSnapshot]:
    """Every Cluster version after ``after_version``; re-opens a broken stream until stopped."""
    version, retry_s = after_version, _RETRY_MIN_S
    while not stop.is_set():
        call = stub.WatchCluster(
            coordinator_pb2.WatchClusterRequest(after_version=version), wait_for_ready=True
        )
        try:
            for msg in call:
                version, retry_s = msg.version, _RETRY_MIN_S
                yield ClusterSnapshot.from_proto(msg)
            reason = "the coordinator ended the stream"
        except grpc.RpcError as err:
            reason = f"{err.code().name}: {err.details()}"
        finally:
            call.cancel()
        if stop.is_set():
            return
        print(
            f"collectives status: watch on {address} interrupted ({reason}); "
            f"re-opening in {retry_s:g} s",
            file=sys.stderr,
            flush=True,
        )
        stop.wait(retry_s)
        retry_s = min(retry_s * 2, _RETRY_MAX_S)


def _watch(args: argparse.Namespace, session: _Session) -> int:
    channel = session.open_channel(args.coordinator, args.security)
    try:
        try:
            first = _get_cluster(channel, args.coordinator, args.timeout)
        except CollectiveError as err:
            return _unreachable("status", args.coordinator, args.timeout, err)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        snapshots = _changes(stub, args.coordinator, first.version, session.stop)
        snapshot: ClusterSnapshot | None = first
        while snapshot is not None:
            if args.json:
                print(_json_line(args.coordinator, snapshot), flush=True)
            else:
                stamp = time.strftime("%H:%M:%S")
                print(
                    f"{CLEAR}{format_table(args.coordinator, snapshot, _width(args))}\n"
                    f"(version {snapshot.version} at {stamp}; watching, Ctrl-C to stop)",
                    flush=True,
                )
            snapshot = next(snapshots, None)
        return EXIT_OK
    finally:
        channel.close()


def _top(args: argparse.Namespace) -> int:
    if not _check_timeout("top", args.timeout):
        return EXIT_UNREACHABLE
    if not args.interval > 0:
        print("collectives top: --interval must be positive", file=sys.stderr)
        return EXIT_UNREACHABLE

    def body(session: _Session) -> int:
        channel = session.open_channel(args.coordinator, args.security)
        previous: ClusterSnapshot | None = None
        previous_at = 0.0
        frames = 0
        try:
            while not session.stop.is_set():
                try:
                    snapshot = _get_cluster(channel, args.coordinator, args.timeout)
                except CollectiveError as err:
                    return _unreachable("top", args.coordinator, args.timeout, err)
                now = time.monotonic()
                rates = rates_between(previous, snapshot, now - previous_at)
                print(
                    f"{CLEAR}{format_top(args.coordinator, snapshot, rates, _width(args))}",
                    flush=True,
                )
                previous, previous_at = snapshot, now
                frames += 1
                if args.iterations and frames >= args.iterations:
                    return EXIT_OK
                session.stop.wait(args.interval)
            return EXIT_OK
        finally:
            channel.close()

    return _until_stopped(body)


def _flight(args: argparse.Namespace) -> int:
    if not _check_timeout(args.command, args.timeout):
        return EXIT_UNREACHABLE
    try:
        snapshot = fetch_status(args.coordinator, args.timeout, args.security)
    except CollectiveError as err:
        return _unreachable(args.command, args.coordinator, args.timeout, err)
    run = run_trace if args.command == "trace" else run_diagnose
    return run(args, snapshot)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``collectives`` console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return code
    except KeyboardInterrupt:  # Ctrl-C before the command's own handler is installed
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader stopped reading (`| head`): not an error
        _silence_stdout()
        return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    try:
        args.security = _security(args)
        parse_addresses(args.coordinator)
    except ValueError as exc:
        print(f"collectives {args.command}: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    reason = refused_within(args.coordinator, min(REFUSED_GRACE_S, args.timeout))
    if reason is not None:
        print(
            f"collectives {args.command}: cannot reach the coordinator at {args.coordinator}: "
            f"{reason}. Is it running? `collectives-server local` prints the address it "
            "listens on.",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    other = None if args.security.tls else other_protocol(args.coordinator, min(1.0, args.timeout))
    if other is not None:
        print(f"collectives {args.command}: {other}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.command == "status":
        return _status(args)
    if args.command == "top":
        return _top(args)
    if args.command in ("trace", "diagnose"):
        return _flight(args)
    if args.command == "drain":
        return run_drain(args)
    if args.command == "rollout":
        return run_rollout(args)
    return EXIT_UNREACHABLE  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    raise SystemExit(main())
