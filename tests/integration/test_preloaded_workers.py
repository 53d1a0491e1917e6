"""Workers forked from the preloaded zygote behave as ``Popen`` children would: standard
output on the pipe, exit codes (negative for a signal), and nothing left when closed."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
from helpers import connect_ready, wait_until

from collectives_server.preloaded_workers import PreloadedWorkers


@pytest.fixture
def workers():
    zygotes = PreloadedWorkers()
    yield zygotes
    zygotes.close()


def test_output_and_exit_codes_are_a_processs(workers: PreloadedWorkers) -> None:
    helped = workers.start(["worker", "--help"], dict(os.environ))
    assert helped.wait(60) == 0
    assert b"--coordinator" in helped.stdout.read()
    refused = workers.start(["worker", "--no-such-flag"], dict(os.environ))
    assert refused.wait(60) == 2


def test_a_signal_is_a_negative_code_and_close_ends_the_zygote(
    workers: PreloadedWorkers,
) -> None:
    # A worker whose coordinator never answers keeps trying: it stays up until killed.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    waiting = workers.start(["worker", "--coordinator", "127.0.0.1:9", "--port", "0"], env)
    assert waiting.poll() is None
    zygote = workers.zygote_pid
    assert zygote is not None and Path(f"/proc/{waiting.pid}").exists()
    cmdline = Path(f"/proc/{waiting.pid}/cmdline")
    wait_until(  # what ps shows: the worker's own command line, not the zygote's
        lambda: b"collectives_server worker --coordinator 127.0.0.1:9" in cmdline.read_bytes(),
        30,
        "the worker's command line",
    )
    waiting.send_signal(signal.SIGKILL)
    assert waiting.wait(30) == -signal.SIGKILL
    workers.close()
    wait_until(lambda: not Path(f"/proc/{zygote}").exists(), 10, "the zygote to be reaped")


def test_a_stop_signal_sent_right_after_the_start_is_never_lost(
    workers: PreloadedWorkers,
) -> None:
    """SIGINT or SIGTERM sent the moment the zygote reports a worker started (a launcher
    stopping everything as it restarts one) ends it. The zygote ignores SIGINT and a
    forked child inherits that until it sets its own, so a signal in that window was
    dropped and the worker ran on until it was killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = []
    for i in range(12):
        sig = signal.SIGINT if i % 2 else signal.SIGTERM
        process = workers.start(["worker", "--coordinator", "127.0.0.1:9", "--port", "0"], env)
        process.send_signal(sig)
        started.append((process, sig))
    for process, sig in started:
        code = process.wait(30)  # (SIGINT before its handlers: the default action)
        assert code in (0, -sig), f"pid {process.pid}: exit {code} after {sig.name}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_a_worker_still_waiting_for_its_coordinator(
    workers: PreloadedWorkers, sig: signal.Signals
) -> None:
    """A worker whose coordinator accepts its connection and never answers waits for it
    up to ``--connect-timeout-s``; a stop signal then (its handlers installed, so no
    default action) ends it at once. The handler only runs on the main thread, which
    sat in the Register call until the connect timeout: the stop waited it out."""
    silent = socket.create_server(("127.0.0.1", 0))
    silent.settimeout(60)
    try:
        port = silent.getsockname()[1]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        args = ["worker", "--coordinator", f"127.0.0.1:{port}", "--port", "0"]
        process = workers.start([*args, "--connect-timeout-s", "600"], env)
        connection, _ = silent.accept()  # its Register dialled: its handlers are set
        with connection:
            process.send_signal(sig)
            code = process.wait(30)
        assert code == 0, f"exit {code} after {sig.name}"
    finally:
        silent.close()


def test_a_listening_zygote_serves_another_launcher_and_ends_what_it_leaves(
    tmp_path: Path,
) -> None:
    """Another launcher connected to a listening zygote gets its workers' pids and exit
    codes; when its connection closes, the workers it did not stop are ended."""
    path = tmp_path / "zygote.sock"
    owner = PreloadedWorkers(listen=str(path))
    try:
        owner.ensure_started()
        assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
        other = PreloadedWorkers(connect=str(path))
        helped = other.start(["worker", "--help"], dict(os.environ))
        assert helped.wait(60) == 0
        left = other.start(
            ["worker", "--coordinator", "127.0.0.1:9", "--port", "0"], dict(os.environ)
        )
        assert left.poll() is None
        parent = int(Path(f"/proc/{left.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent == owner.zygote_pid  # the owner's zygote forked it
        other.close()  # as a launcher that died: its worker is ended by the zygote
        wait_until(lambda: not Path(f"/proc/{left.pid}").exists(), 30, "the left worker to end")
    finally:
        owner.close()
    assert not path.exists()


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_test_clusters_workers_come_from_this_processs_one_zygote(local_cluster) -> None:
    """The tests' clusters fork their workers from this test process's zygote, whatever
    started it first (the fault harness's workers or a cluster): no launcher of a
    test cluster pays for an interpreter that imports torch again."""
    client = connect_ready(local_cluster(2), 2)
    try:
        pids = [w.pid for w in client.workers()]
    finally:
        client.close()
    zygotes = {_parent_of(pid) for pid in pids}
    assert len(zygotes) == 1, zygotes
    zygote = zygotes.pop()
    assert "collectives_server.preloaded_workers" in Path(f"/proc/{zygote}/cmdline").read_text()
    assert _parent_of(zygote) == os.getpid()  # this process's, not a launcher's own
