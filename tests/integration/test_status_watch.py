"""``collectives status --watch`` shows a worker kill within seconds, and stops
cleanly on SIGTERM; ``collectives top`` draws a live per-worker view."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import LEASE_S, wait_until

COLLECTIVES_CLI = str(Path(sys.executable).with_name("collectives"))
# Lease expiry plus the survivors re-forming: "within seconds".
DETECT_S = LEASE_S + 8.0


class Lines:
    """A child's stdout, line by line, read with deadlines (never a blocking read)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def until(self, predicate, timeout_s: float, what: str):
        """The first parsed JSON line for which ``predicate`` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no line with {what} within {timeout_s:g} s: {self.seen[-3:]}"
                )
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"the watcher exited before {what}: {self.seen[-3:]}")
            self.seen.append(line)
            data = json.loads(line)
            if predicate(data):
                return data


def _members(data: dict) -> dict[int, dict]:
    return {w["rank"]: w for w in data["workers"] if w["rank"] >= 0}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_status_watch_json_shows_a_kill_and_stops_on_sigterm(fresh_cluster):
    local, _ = fresh_cluster(3, "--min-workers", "2")
    watcher = subprocess.Popen(
        [COLLECTIVES_CLI, "status", "--coordinator", local.address, "--watch", "--json"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = Lines(watcher)
        first = lines.until(
            lambda d: d["formed"] and len(_members(d)) == 3
            and all(w["state"] == "ready" for w in _members(d).values()),
            30, "3 ready members",
        )  # fmt: skip
        generation = first["generation"]
        victim = _members(first)[2]
        assert local.owns(victim["pid"])
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()

        def lost_and_reformed(d: dict) -> bool:
            states = {w["address"]: w["state"] for w in d["workers"]}
            return (
                states.get(victim["address"]) == "lost"
                and d["generation"] > generation
                and d["world_size"] == 2
            )

        seen = lines.until(lost_and_reformed, DETECT_S, f"{victim['address']} lost")
        assert time.monotonic() - killed_at < DETECT_S
        assert victim["address"] not in [w["address"] for w in _members(seen).values()]
        assert seen["history"][-1]["generation"] == seen["generation"]
        assert "lost" in seen["history"][-1]["reason"], seen["history"][-1]

        watcher.send_signal(signal.SIGTERM)
        code = watcher.wait(timeout=15)
        assert code == 0, watcher.stderr.read() if watcher.stderr else code
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=10)


@pytest.mark.timeout(120)
def test_status_watch_table_redraws_and_top_shows_ops(cluster2_address, cluster2, uname):
    watcher = subprocess.Popen(
        [COLLECTIVES_CLI, "status", "--coordinator", cluster2_address, "--watch"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=dict(os.environ, COLUMNS="250"),
    )  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(watcher.stdout or []), daemon=True)
    reader.start()
    name = uname("watch")
    try:
        cluster2.put(name, torch.zeros(8))  # a status change: the table is redrawn

        def redrawn():
            return "".join(out).count("\x1b[H\x1b[2J") >= 2

        wait_until(redrawn, 15, "the table to be redrawn after a change")
        watcher.send_signal(signal.SIGINT)  # Ctrl-C
        assert watcher.wait(timeout=15) == 0
        reader.join(timeout=5)
        text = "".join(out)
        for w in cluster2.workers():
            assert w.address in text
        assert "TENSORS" in text and "OPS_OK" in text
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=10)
        cluster2.delete(name, missing_ok=True)

    top = subprocess.run(
        [COLLECTIVES_CLI, "top", "--coordinator", cluster2_address, "--iterations", "2",
         "--interval", "0.2", "--wide"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert top.returncode == 0, top.stderr
    frames = top.stdout.split("\x1b[H\x1b[2J")
    assert len([f for f in frames if f.strip()]) == 2, top.stdout
    for w in cluster2.workers():
        assert w.address in frames[-1]
    assert "OPS/S" in frames[-1] and "QUEUE" in frames[-1]
