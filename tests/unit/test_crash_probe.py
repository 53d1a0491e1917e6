"""A worker whose process is gone is lost at once; one that may be alive is left to its
lease (``coordinator/crash_probe.py``, ``Membership.crashed``)."""

from __future__ import annotations

import socket
import threading
import time

from collectives.wire.cluster_state import WorkerState
from collectives_server.coordinator.crash_probe import process_gone
from collectives_server.coordinator.membership import Membership


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens


def test_a_port_nothing_listens_on_means_the_process_is_gone() -> None:
    assert process_gone(f"127.0.0.1:{_closed_port()}", threading.Event(), 1.0)


def test_a_listening_port_or_a_stop_proves_nothing() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        began = time.monotonic()
        assert not process_gone(address, threading.Event(), 0.3)
        assert time.monotonic() - began < 5.0  # patience ends it, not the listener
    stopping = threading.Event()
    stopping.set()
    assert not process_gone(f"127.0.0.1:{_closed_port()}", stopping, 1.0)
    assert not process_gone("no-port-here", threading.Event(), 1.0)


def test_a_listener_that_outlives_the_stream_is_waited_for_within_the_patience() -> None:
    """On a busy host the kernel can close a killed process's listener well after its
    stream: the probe keeps asking (past its first few attempts) and sees the refusal."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    accepted = 0

    def serve_then_close() -> None:
        nonlocal accepted
        while accepted < 12:  # the old probe gave up after 3 connections
            conn, _ = listener.accept()
            conn.close()
            accepted += 1
        listener.close()

    closer = threading.Thread(target=serve_then_close, daemon=True)
    closer.start()
    try:
        assert process_gone(address, threading.Event(), 30.0)
        assert accepted == 12
    finally:
        closer.join(timeout=10)
        listener.close()


def test_a_worker_heard_from_again_ends_the_probe() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        asked = 0

        def still_suspect() -> bool:
            nonlocal asked
            asked += 1
            return asked < 4  # its stream opened again after the third attempt

        began = time.monotonic()
        assert not process_gone(address, threading.Event(), 30.0, still_suspect)
        assert asked == 4 and time.monotonic() - began < 10.0


def test_a_crashed_member_is_lost_at_once_and_the_survivors_reseal() -> None:
    m = Membership(2, 3, lease_s=30.0, join_window_s=0.0, id_prefix="t")
    ids = [m.register(0.0, address=f"127.0.0.1:{p}", pid=p, devices=["cpu"])[0] for p in (1, 2, 3)]
    generation = m.generation
    outcome = m.crashed(1.0, ids[1], "its stream closed")
    assert outcome.changed and outcome.sealed and ids[1] in outcome.lost
    assert "lost: its stream closed" in outcome.reason
    assert m.generation == generation + 1 and m.members == (ids[0], ids[2])
    states = {w.worker_id: w.state for w in m.view(1.0).workers}
    assert states[ids[1]] is WorkerState.LOST
    # Not live any more (or never known): nothing changes.
    assert not m.crashed(1.5, ids[1], "again").changed
    assert not m.crashed(1.5, "nobody", "unknown").changed
