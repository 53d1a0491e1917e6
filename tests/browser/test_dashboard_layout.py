"""The dashboard's layout and what it derives, in a real headless Chromium.

At a 1280x800 viewport the page has no horizontal scroll (nor any table scrolled
sideways), with a row's details open too; under load (a client doing small
all_reduces) each worker's ops/s goes above 0 with a sparkline and keeps
changing; a collective that fails on both ranks is one failed-ops row; the
timeline holds the generation sealed and the joins. The screenshot is
``artifacts/dashboard-1280x800.png``. A fake cluster with a history (a loss, a
leader change, a restart) and very long names checks the timeline rebuilt on
load and that long words never widen the page.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest
import torch
from dashboard_page import ARTIFACTS, FixedSource, fits, screenshot, set_viewport, text
from launcher import free_port

import collectives

log = logging.getLogger(__name__)

_RATES_JS = """
const live = '#worker-rows tr[data-worker-id]:not([data-state="lost"])';
return Array.from(document.querySelectorAll(live))
  .map(r => [r.dataset.workerId, r.dataset.opsRate, r.querySelector('td.rate').textContent,
             r.querySelectorAll('td.rate polyline').length]);
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dashboard_fits_1280x800_and_shows_rates_under_load(browser, fresh_cluster, uname, gen):
    """At 1280x800 no horizontal scroll, ops/s moving under load, the timeline."""
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    _, client = fresh_cluster(2, "--dashboard-port", str(port))
    # The viewport, not the outer window, must be 1280x800 (headless has no chrome
    # around the page, but say it exactly).
    set_viewport(browser)
    browser.get(f"http://127.0.0.1:{port}/")
    WebDriverWait(browser, 30, poll_frequency=0.1).until(
        lambda d: len(d.execute_script(_RATES_JS)) == 2, "2 live worker rows"
    )
    fits(browser)
    # The timeline was rebuilt from the history on load: the first generation sealed.
    assert browser.find_elements("css selector", '#timeline-rows tr[data-kind="sealed"]')
    assert browser.find_elements("css selector", '#timeline-rows tr[data-kind="joined"]')
    # One time format: HH:MM:SS, the zone once in the header.
    zone = text(browser, "zone")
    assert re.fullmatch(r"· times in UTC[+-]\d\d:\d\d", zone), zone
    times = browser.execute_script(
        "return Array.from(document.querySelectorAll('#timeline-rows td:first-child'))"
        ".map(td => td.textContent);"
    )
    assert times and all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in times), times

    # Load: small all_reduces of fresh random data, from a thread, until told to stop.
    name = uname("load")
    client.put(name, torch.randn(256, generator=gen))
    stop = threading.Event()
    done: list[int] = []
    progress = [0]  # all_reduces finished so far
    failures: list[BaseException] = []

    def load() -> None:
        count = 0
        deadline = time.monotonic() + 120.0
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                client.all_reduce(name, op="max", timeout=10.0)
                count += 1
                progress[0] = count
        except BaseException as e:  # reported by the test thread
            failures.append(e)
        done.append(count)

    loader = threading.Thread(target=load, name="dashboard-load", daemon=True)
    loader.start()
    try:

        def rates_up(driver) -> bool:
            rows = driver.execute_script(_RATES_JS)
            return len(rows) == 2 and all(r and float(r) > 0 and n == 1 for _, r, _, n in rows)

        WebDriverWait(browser, 30, poll_frequency=0.2).until(
            rates_up, "ops/s > 0 with a sparkline for both workers under load"
        )
        first = {w: cell for w, _, cell, _ in browser.execute_script(_RATES_JS)}
        start, start_count = time.monotonic(), progress[0]
        # Over 5 s of load (a condition with a deadline, not a sleep), the cells
        # move, and the page's ops/s agrees with what the client measures: each
        # all_reduce is one op on every worker.
        WebDriverWait(browser, 20, poll_frequency=0.2).until(
            lambda d: (
                time.monotonic() - start >= 5.0
                and any(first[w] != cell for w, _, cell, _ in d.execute_script(_RATES_JS))
            ),
            "the ops/s cells to change as the load goes on",
        )
        client_rate = (progress[0] - start_count) / (time.monotonic() - start)
        shown = [float(r) for _, r, _, _ in browser.execute_script(_RATES_JS)]
        log.info(f"client all_reduce/s {client_rate:.1f}, page ops/s per worker {shown}")
        assert all(client_rate / 3 <= r <= client_rate * 3 for r in shown), (client_rate, shown)
        assert not failures, failures
        assert float(text(browser, "cluster-rate")) > 0
        # A collective that fails on every rank is one entry (its op id), reported by both.
        with pytest.raises(collectives.NotFound):
            client.all_reduce(uname("missing"), timeout=10.0)
        WebDriverWait(browser, 15, poll_frequency=0.2).until(
            lambda d: d.find_elements(
                "css selector", '#error-rows tr[data-reporters="2"]:not([data-op-id="0"])'
            ),
            "the failed all_reduce as one row reported by 2 ranks",
        )
        # Details open on a click, below the row, and still fit.
        # (Rows are replaced on every update: act and read in one script each.)
        browser.execute_script("document.querySelector('#worker-rows tr[data-worker-id]').click();")
        details = WebDriverWait(browser, 10, poll_frequency=0.1).until(
            lambda d: d.execute_script(
                "const r = document.querySelector('#worker-rows tr.details');"
                "return r ? r.textContent : null;"
            ),
            "the details row",
        )
        assert "torch" in details and "all_reduce" in details, details
        fits(browser)
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / "dashboard-1280x800.png"
        assert browser.save_screenshot(str(path)), f"could not save {path}"
        log.info(f"screenshot: {path}")
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], f"the page logged errors: {errors}"
    finally:
        stop.set()
        loader.join(timeout=15.0)
    assert not loader.is_alive(), "the load thread did not stop"
    assert done and done[0] > 0 and not failures, (done, failures)


# ------------------------------------------------- the timeline from the history


class _HistorySource(FixedSource):
    """A cluster whose history shows a loss, a leader change and a restart."""

    def __init__(self) -> None:
        from collectives.v1 import coordinator_pb2, status_pb2

        a, b = "127.0.0.1:7001", "127.0.0.1:7002"
        cluster = coordinator_pb2.Cluster(
            generation=3, formed=True, ready=True, world_size=2, version=9, status="ok"
        )
        t0 = time.time() - 600
        for gen, members, reason in (
            (1, [a, b], "formed"),
            (2, [b], f"{a} lost"),
            (3, [b, a], f"{a} joined again"),
        ):
            cluster.history.add(
                generation=gen, sealed_unix_time_s=t0 + 60 * gen, world_size=len(members),
                members=members, reason=reason,
            )  # fmt: skip
        for rank, address in enumerate((b, a)):
            cluster.workers.add(
                worker_id=f"w{rank}", rank=rank, address=address, hostname="h", pid=rank + 1,
                state=coordinator_pb2.WORKER_STATE_READY, devices=["cpu"],
            )  # fmt: skip
        # Long words anywhere must wrap or be cut, never widen the page.
        status = status_pb2.WorkerStatus(models=["m" * 300], last_op="x" * 200)
        status.recent_errors.add(
            unix_time_s=t0, op_id=5, generation=1, kind="all_reduce", code="INTERNAL",
            message="e" * 500,
        )  # fmt: skip
        cluster.workers.add(
            worker_id="w" * 80, rank=-1, address="[fd00:1234:5678:9abc:def0:1234:5678:9abc]:65535",
            hostname="h" * 200, pid=99, state=coordinator_pb2.WORKER_STATE_LOST,
            devices=[f"cuda:{i}" for i in range(8)], status=status,
        )  # fmt: skip
        super().__init__(cluster)


def test_dashboard_timeline_from_the_history(browser):
    """On load the timeline is rebuilt from the history: joins, a loss, a leader change,
    a restart, every generation sealed, newest first, in one time format."""
    from selenium.webdriver.support.ui import WebDriverWait

    from collectives_server.coordinator.dashboard.server import DashboardServer

    dashboard = DashboardServer(_HistorySource(), port=0, refresh_s=0.5).start()
    try:
        set_viewport(browser)
        browser.get(f"http://{dashboard.address}/")
        js = (
            "return Array.from(document.querySelectorAll('#timeline-rows tr[data-kind]'))"
            ".map(r => [r.dataset.kind, r.cells[0].textContent, r.cells[2].textContent]);"
        )
        rows = WebDriverWait(browser, 15, poll_frequency=0.1).until(
            lambda d: d.execute_script(js) if len(d.execute_script(js)) >= 8 else None,
            "the timeline rebuilt from 3 generations",
        )
        kinds = [kind for kind, _, _ in rows]
        assert kinds.count("sealed") == 3
        assert kinds.count("joined") == 2
        assert {"lost", "leader", "restarted"} <= set(kinds), kinds
        sealed = browser.execute_script(
            "return Array.from(document.querySelectorAll('#timeline-rows tr[data-generation]'))"
            ".map(r => r.dataset.generation);"
        )
        assert sealed == ["3", "2", "1"], "newest first"
        assert all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for _, t, _ in rows), rows
        leader = next(detail for kind, _, detail in rows if kind == "leader")
        assert "now 127.0.0.1:7002, was 127.0.0.1:7001" in leader
        fits(browser)
        browser.execute_script(
            "document.querySelector('#worker-rows tr[data-state=lost]').click();"
        )
        WebDriverWait(browser, 5, poll_frequency=0.1).until(
            lambda d: d.find_elements("css selector", "#worker-rows tr.details"), "the details row"
        )
        fits(browser)
        screenshot(browser, "long-names")
    finally:
        dashboard.stop()
