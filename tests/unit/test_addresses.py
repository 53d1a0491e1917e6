"""Coordinator addresses are checked up front, and a wrong one fails at once."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

import collectives
from collectives.addresses import REFUSED_GRACE_S, parse_address, refused_within
from collectives_server import hosts


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:50051", ("127.0.0.1", 50051)), (" host-a:1 ", ("host-a", 1)),
     ("[::1]:7", ("::1", 7))],
)  # fmt: skip
def test_host_port_is_parsed(text, expected) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    ("text", "hint"),
    [("127.0.0.1", "has no port"), ("http://h:5", "is a URL"), ("h:0", "1..65535"),
     ("h:99999", "1..65535"), ("h:port", "1..65535"), ("::1:5", "brackets"), ("", "host:port"),
     ("a b:5", "not host:port"), (None, "host:port")],
)  # fmt: skip
def test_malformed_addresses_are_refused_with_a_hint(text, hint) -> None:
    with pytest.raises(collectives.InvalidArgument, match=hint):
        parse_address(text)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_port_is_reported_and_an_open_one_is_not() -> None:
    port = _closed_port()
    assert "refused" in (refused_within(f"127.0.0.1:{port}", 0.2) or "")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert refused_within(f"127.0.0.1:{listener.getsockname()[1]}") is None


def test_connect_to_a_closed_port_fails_without_waiting_out_its_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(collectives.Unavailable, match="refused"):
        collectives.connect(f"127.0.0.1:{_closed_port()}", timeout=30)
    # The grace period plus slack for a loaded machine, far below the 30 s timeout.
    assert time.monotonic() - started < REFUSED_GRACE_S + 5


def test_cli_status_of_a_closed_port_fails_at_once_with_a_hint() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "collectives.cli.main", "status", "--coordinator",
         f"127.0.0.1:{_closed_port()}", "--timeout", "30"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "refused" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < REFUSED_GRACE_S + 5


def test_the_cli_does_not_import_torch() -> None:
    """`collectives --help` and `status` start fast: torch is never imported on that path."""
    code = (
        "import sys\n"
        "from collectives.cli.main import main\n"
        "try:\n"
        "    main(['status', '--coordinator', '127.0.0.1:1', '--timeout', '0.2'])\n"
        "finally:\n"
        "    print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout + done.stderr
    assert "cannot reach the coordinator" in done.stderr, done.stderr


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "[::]", None])
def test_every_wildcard_host_is_dialled_by_this_machines_name(host: str | None) -> None:
    assert hosts.is_wildcard(host)
    assert hosts.dialled_name(host) == socket.gethostname()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "worker-3.cluster.local"])
def test_a_named_host_is_dialled_as_it_is(host: str) -> None:
    assert not hosts.is_wildcard(host)
    assert hosts.dialled_name(host) == host
