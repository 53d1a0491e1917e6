"""The dashboard's op timeline in a real headless Chromium at 1280x800.

A follower of a 3-worker cluster is stopped (SIGSTOP) before an all_reduce and
resumed once the other ranks are inside it: while it is stopped the page shows
the stuck op on the two ranks inside it (the stopped rank cannot report); once
it resumed, the op's bars on every rank, and rank 1's marked as the rank the
others waited for. Nothing may scroll sideways. The screenshot is
``artifacts/dashboard-op-timeline-1280x800.png``.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from dashboard_page import ARTIFACTS, fits, set_viewport
from launcher import free_port, stop_process

_STUCK_JS = """
return Array.from(document.querySelectorAll('#stuck .stuck-line')).map(n => n.textContent);
"""
_BARS_JS = """
return Array.from(document.querySelectorAll('#op-timeline .op-bar'))
  .map(b => [b.dataset.op, Number(b.dataset.rank), b.dataset.phase, b.dataset.slowest, b.title]);
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_op_timeline_marks_the_rank_the_others_waited_for(browser, fresh_cluster) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    local, cluster = fresh_cluster(
        3, "--dashboard-port", str(port), "--op-timeout-s", "8", "--lease", "30"
    )
    name = "timeline/slow"
    cluster.put(name, torch.ones(1 << 18))  # past the inline bound: the data moves
    slow = sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)[1]
    assert local.owns(slow.pid)
    set_viewport(browser)
    browser.get(f"http://127.0.0.1:{port}/")
    stop_process(slow.pid)
    try:
        handle = cluster.all_reduce(name, async_op=True, timeout=60)

        def both_running_ranks_stuck(driver):
            # Each worker's verdict rides its own heartbeat, so the two running
            # ranks' lines reach the page at different moments: wait for both.
            lines = [s for s in driver.execute_script(_STUCK_JS) if f"all_reduce '{name}'" in s]
            ranks = sorted(line.split(" ", 2)[1] for line in lines)
            return lines if ranks == ["0", "2"] else None

        stuck = WebDriverWait(browser, 30, poll_frequency=0.25).until(
            both_running_ranks_stuck, "the stuck all_reduce on ranks 0 and 2 of the page"
        )
        assert stuck[0].startswith("rank 0 ") and stuck[1].startswith("rank 2 "), stuck
    finally:
        os.kill(slow.pid, signal.SIGCONT)
    handle.result(timeout=60)
    cluster.barrier()  # one more op: its heartbeats carry the finished all_reduce

    def marked(driver):
        bars = [b for b in driver.execute_script(_BARS_JS) if f"'{name}'" in b[4]]
        running = {b[1]: b[3] for b in bars if b[2] == "running"}
        done = sorted(running) == [0, 1, 2] and not driver.execute_script(_STUCK_JS)
        return running if done else None

    running = WebDriverWait(browser, 30, poll_frequency=0.25).until(
        marked, "the all_reduce's bars on every rank, the stuck line gone"
    )
    assert running == {0: "false", 1: "true", 2: "false"}, running
    fits(browser)
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "dashboard-op-timeline-1280x800.png"
    assert browser.save_screenshot(str(path)), f"could not save {path}"
    logged = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert logged == [], f"the page logged errors: {logged}"
