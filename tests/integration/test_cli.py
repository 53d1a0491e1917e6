"""The command lines as a user meets them: ``collectives-server local`` prints the
coordinator address first and stops cleanly on SIGTERM; ``collectives status``
shows a running cluster as a table or JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_tensor, get_each, put_each, reduce_oracle, wait_until

COLLECTIVES_CLI = str(Path(sys.executable).with_name("collectives"))


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_local_first_run_ops_at_once_then_sigterm(fresh_cluster, gen):
    """A new user's first run: ops issued the moment connect() returns succeed
    (the workers may still be joining the process group), and SIGTERM stops the
    launcher and its children with exit code 0."""
    local, cluster = fresh_cluster(2, wait_ready=False)
    host, _, port = local.address.rpartition(":")
    assert host == "127.0.0.1" and port.isdigit() and int(port) > 0, local.address

    assert cluster.barrier(timeout=60) is None  # a collective first, before any data
    inputs = [torch.randn(3, generator=gen) for _ in range(2)]
    put_each(cluster, "first", inputs)
    cluster.all_reduce("first", op="max", timeout=60)
    for rank, got in enumerate(get_each(cluster, "first")):
        assert_tensor(got, reduce_oracle("max", inputs), what=f"rank {rank}")
    pids = [w.pid for w in cluster.workers()]
    assert len(pids) == 2 and all(local.owns(pid) for pid in pids), pids
    cluster.close()

    code = local.stop(timeout_s=30)

    assert code == 0, f"the launcher exited with {code} on SIGTERM\n{local.log_tail()}"
    wait_until(lambda: not any(_alive(p) for p in pids), 10, "the workers to exit")


def test_status_table_and_json(cluster2_address, cluster2):
    workers = cluster2.workers()
    env = dict(os.environ, COLUMNS="200")
    table = subprocess.run(
        [COLLECTIVES_CLI, "status", "--coordinator", cluster2_address],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    for w in workers:
        assert w.address in table.stdout, table.stdout

    raw = subprocess.run(
        [COLLECTIVES_CLI, "status", "--coordinator", cluster2_address, "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert raw.returncode == 0, raw.stderr
    data = json.loads(raw.stdout)
    assert data["world_size"] == 2, data
    assert data["generation"] == cluster2.generation, data


def test_status_of_nothing_exits_nonzero_quickly():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [COLLECTIVES_CLI, "status", "--coordinator", f"127.0.0.1:{port}", "--timeout", "2"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr + result.stdout


@pytest.mark.parametrize("argv", [["--help"], ["local", "--help"], ["worker", "--help"]])
def test_server_cli_help(argv):
    result = subprocess.run(
        [sys.executable, "-m", "collectives_server", *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


# What a reader that stopped reading must never see on the CLI's stderr.
_PIPE_NOISE = ("Traceback", "BrokenPipeError", "Exception ignored")
# The CLI's start (interpreter, imports) plus its stop, for a closed pipe.
_PIPE_EXIT_S = 30.0


@pytest.mark.parametrize(
    ("argv", "lines"),
    [
        (["status", "--watch"], 3),
        (["status", "--watch", "--json"], 1),
        (["top", "--interval", "600"], 3),  # nothing more to write for longer than we wait
        (["top", "--interval", "0.05"], 3),  # writing all the time
        (["status"], 1),
    ],
    ids=["status-watch", "status-watch-json", "top-idle", "top-busy", "status"],
)
def test_a_closed_pipe_ends_the_command_quietly(cluster2_address, cluster2, argv, lines):
    """``collectives status --watch | head -n 3``: once the reader is gone the command
    exits 0 with nothing on stderr, also while the cluster does not change (nothing
    more to write) and while it keeps writing (``top``)."""
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.Popen(
        [COLLECTIVES_CLI, *argv, "--coordinator", cluster2_address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        got: list[str] = []
        reader = threading.Thread(
            target=lambda: got.extend(next(proc.stdout) for _ in range(lines))
        )
        reader.start()
        reader.join(_PIPE_EXIT_S)
        assert len(got) == lines, (got, proc.poll())
        proc.stdout.close()  # the reader is gone, as `head` exits
        code = proc.wait(timeout=_PIPE_EXIT_S)
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, (code, stderr)
    assert not any(noise in stderr for noise in _PIPE_NOISE), stderr


@pytest.mark.parametrize("command", ["status --watch", "top"])
def test_piped_into_head_the_pipeline_ends_with_status_0(cluster2_address, cluster2, command):
    """The shell line a user types, with ``pipefail``: every member of it exits 0."""
    line = f"{COLLECTIVES_CLI} {command} --coordinator {cluster2_address} | head -n 3"
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", line],
        capture_output=True, text=True, timeout=_PIPE_EXIT_S * 2, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result
    assert len(result.stdout.splitlines()) == 3, result.stdout
    assert not any(noise in result.stderr for noise in _PIPE_NOISE), result.stderr
