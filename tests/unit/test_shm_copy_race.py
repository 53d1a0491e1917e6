"""A get written into a client's segment survives the client giving the call up.

A client whose get runs out of time unlinks the segment it had leased; the worker,
slow or stopped until then, may still be copying the tensor into it. The worker's
reaper unmaps mappings whose name is gone: it unmapped this one under the copy,
and the copy's threads wrote into unmapped memory (the worker died of SIGSEGV; a
fault test saw it, in about one run of two under load). The race runs here in a
child process, so that the crash it guards against fails the test instead of the
suite: a copy of 32 MiB, the segment unlinked as it starts, the reaper called
until the copy ends.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from collectives.wire import shm

RACE = r"""
import os, sys, threading, time, uuid
import torch
from collectives_server.worker.data.shm_adopt import AdoptedSegments

segments = AdoptedSegments()
nbytes = 32 << 20
wire = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(1))
for _ in range(int(sys.argv[1])):
    path = f"{sys.argv[2]}/collectives-race-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        started = threading.Event()

        def copy():
            started.set()
            segments.copy_into(fd, path, 0, wire)

        writer = threading.Thread(target=copy)
        writer.start()
        started.wait(10)
        os.unlink(path)  # the client gave the call up
        deadline = time.monotonic() + 10
        while writer.is_alive() and time.monotonic() < deadline:
            segments.reap()
        writer.join(10)
        assert not writer.is_alive(), "the copy did not end"
        view = os.pread(fd, 16, nbytes - 16)
        assert view == wire.numpy().tobytes()[-16:], "the copy did not land"
    finally:
        os.close(fd)
        if os.path.exists(path):
            os.unlink(path)
print("ok")
"""


@pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
def test_a_copy_into_a_given_up_segment_is_never_unmapped_under_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", RACE, "12", shm.SHM_DIR],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        f"exit {done.returncode} (-11: SIGSEGV, the mapping was unmapped under the copy)\n"
        f"{done.stderr[-2000:]}"
    )
