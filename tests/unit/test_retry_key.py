"""A worker's retry key is its own process's: a worker forked from the preloaded
interpreter must not carry its parent's (or a sibling's), or a restarted worker on a
dead one's address would pass for the dead one retrying its Register."""

from __future__ import annotations

import os

from collectives_server.worker.enrolment import retry_key


def test_a_forked_process_makes_its_own_retry_key() -> None:
    mine = retry_key()
    assert retry_key() == mine  # stable within a process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its key, then leave without running pytest's exit
        try:
            os.write(write, retry_key().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pipe.read().decode()
    os.waitpid(pid, 0)
    assert len(theirs) == len(mine) and theirs != mine
