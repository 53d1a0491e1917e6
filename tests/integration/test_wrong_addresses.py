"""Clear answers to wrong addresses: a worker's port, an HTTP port, a silent one.

A user who gives the SDK or ``collectives status`` a worker's port is told it is
a worker and where its coordinator is; an HTTP port (the dashboard's) is named
as such at once rather than after the timeout; an address where nothing
accepts the connection fails within the timeout the user set, which the
message names.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import wait_until
from launcher import free_port

import collectives

COLLECTIVES_CLI = str(Path(sys.executable).with_name("collectives"))
# Time the CLI may spend beyond its --timeout: interpreter start and imports.
CLI_START_S = 10.0


def _status(address: str, timeout_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = subprocess.run(
        [COLLECTIVES_CLI, "status", "--coordinator", address, "--timeout", f"{timeout_s:g}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return result, time.monotonic() - start


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A port that listens but never completes another connection: its accept
    queue is full, so the kernel drops new handshakes, as an unroutable host would."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    yield f"127.0.0.1:{port}"
    for filler in fillers:
        filler.close()
    server.close()


def test_status_given_a_workers_port_names_the_worker_and_its_coordinator(
    cluster2_address, cluster2
):
    worker = cluster2.workers()[1]
    result, elapsed = _status(worker.address, 20)
    assert result.returncode == 2, result
    assert f"{worker.address} is a collectives worker ({worker.worker_id}, rank 1)" in (
        result.stderr
    ), result.stderr
    assert f"its coordinator is at {cluster2_address}" in result.stderr, result.stderr
    assert "UNIMPLEMENTED" not in result.stderr
    assert elapsed < CLI_START_S, elapsed  # at once, not after the 20 s timeout


def test_status_given_an_http_port_says_so_at_once(fresh_cluster):
    port = free_port()
    _, cluster = fresh_cluster(2, "--dashboard-port", str(port))
    cluster.close()
    result, elapsed = _status(f"127.0.0.1:{port}", 20)
    assert result.returncode == 2, result
    assert f"127.0.0.1:{port} is an HTTP/1 server" in result.stderr, result.stderr
    assert "the coordinator's gRPC address" in result.stderr
    assert elapsed < CLI_START_S, elapsed


def test_status_of_a_silent_address_fails_within_its_timeout_and_says_which(silent_address):
    result, elapsed = _status(silent_address, 2)
    assert result.returncode == 2, result
    assert f"cannot reach the coordinator at {silent_address} within 2 s (--timeout)" in (
        result.stderr
    ), result.stderr
    assert elapsed < 2 + CLI_START_S, elapsed


def test_connect_to_a_silent_address_fails_within_its_timeout(silent_address):
    start = time.monotonic()
    with pytest.raises(collectives.Unavailable) as info:
        collectives.connect(silent_address, timeout=2)
    elapsed = time.monotonic() - start
    assert elapsed < 2 + 1.5, elapsed
    assert "within 2 s" in info.value.message, info.value


def test_connect_to_a_workers_port_names_the_worker_and_its_coordinator(cluster2_address, cluster2):
    worker = cluster2.workers()[0]
    start = time.monotonic()
    with pytest.raises(collectives.InvalidArgument) as info:
        collectives.connect(worker.address, timeout=20)
    assert time.monotonic() - start < 5, "at once, not after the timeout"
    message = info.value.message
    assert f"{worker.address} is a collectives worker ({worker.worker_id}, rank 0)" in message
    assert f"its coordinator is at {cluster2_address}" in message
    assert "UNIMPLEMENTED" not in message


def test_connect_to_an_http_port_says_so_at_once(fresh_cluster):
    port = free_port()
    _, cluster = fresh_cluster(2, "--dashboard-port", str(port))
    cluster.close()
    start = time.monotonic()
    with pytest.raises(collectives.InvalidArgument, match="is an HTTP/1 server"):
        collectives.connect(f"127.0.0.1:{port}", timeout=20)
    assert time.monotonic() - start < 5


def test_a_client_name_given_at_connect_reaches_the_workers(cluster2_address, uname):
    name = uname("trainer").replace("/", "-")
    with collectives.connect(cluster2_address, name=name) as client:
        client.barrier(timeout=30)
        client.put(uname("t"), torch.ones(2), rank=0)

        def named() -> bool:
            snapshot = client.refresh()
            return any(c.name == name for c in snapshot.clients())

        wait_until(named, 30, f"client {name!r} in the workers' client lists")


def test_connect_without_an_address_reads_collectives_coordinator(
    cluster2_address, cluster2, monkeypatch, uname, gen
):
    """The variable the CLI reads for ``--coordinator`` is what ``connect()`` dials."""
    monkeypatch.setenv("COLLECTIVES_COORDINATOR", cluster2_address)
    name, t = uname("env"), torch.randn(5, generator=gen)
    with collectives.connect(timeout=30) as client:
        assert client.address == cluster2_address
        client.put(name, t, rank=1)
        torch.testing.assert_close(client.get(name, rank=1, timeout=30), t)
        client.delete(name, timeout=30)
    with collectives.Cluster(timeout=30) as client:  # the class, too
        assert client.address == cluster2_address


def test_connect_without_an_address_or_the_variable_names_the_variable(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_COORDINATOR", raising=False)
    for connect in (collectives.connect, collectives.Cluster):
        start = time.monotonic()
        with pytest.raises(collectives.InvalidArgument, match="COLLECTIVES_COORDINATOR"):
            connect()
        assert time.monotonic() - start < 1, "a usage error, before any connection"
    monkeypatch.setenv("COLLECTIVES_COORDINATOR", "")  # empty is unset, as for the CLI
    with pytest.raises(collectives.InvalidArgument, match="COLLECTIVES_COORDINATOR"):
        collectives.connect()
