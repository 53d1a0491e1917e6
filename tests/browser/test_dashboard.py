"""The coordinator's dashboard in a real headless Chromium.

A local cluster of 3 workers (``--min-workers 2``) serves its dashboard; the page
must show the three workers ready and the sealed generation, then, without a
reload, show a SIGKILLed worker as lost and the next generation. Screenshots of
both moments are saved as ``artifacts/dashboard-*.png`` (gitignored; CI can keep them).

The workers also host a model that is published once: every row must show it
as ``name v2``. A fixed cluster with one worker behind the others' version of a
model checks that this worker is highlighted (and a lost one is not).

Another test serves a fake cluster whose strings are HTML and script, and checks
that the page shows them as text.

The browser comes from ``conftest.py`` (skips without Chromium outside CI), the
page helpers from ``dashboard_page.py``; the layout at 1280x800, rates and the
timeline are checked in ``test_dashboard_layout.py``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading

import dashboard_page as page
import pytest
import torch
from helpers import LEASE_S, wait_until
from launcher import free_port

import collectives

log = logging.getLogger(__name__)

# Losing a worker: its lease, then the survivors re-form (as in test_failure).
REFORM_S = LEASE_S + 15.0

_STATS_JS = """
return Array.from(document.querySelectorAll('#worker-rows tr[data-state="ready"]'))
  .map(r => [r.dataset.tensorsHeld, r.dataset.opsCompleted]);
"""
# Per worker row: [worker id, data-lagging, [[model text, lagging?], ...]].
_MODELS_JS = """
return Array.from(document.querySelectorAll('#worker-rows tr[data-worker-id]'))
  .map(r => [r.dataset.workerId, r.dataset.lagging,
             Array.from(r.querySelectorAll('td.models .model'))
               .map(m => [m.textContent, m.classList.contains('lagging')])]);
"""
ZOO = ("--allow-factory", "collectives_server.model_zoo")
MLP = {"in_features": 4, "hidden": 3, "out_features": 2}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dashboard_shows_workers_live_and_a_killed_worker_lost(browser, fresh_cluster):
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    local, client = fresh_cluster(3, "--min-workers", "2", "--dashboard-port", str(port), *ZOO)
    members = sorted((w for w in client.workers() if w.rank >= 0), key=lambda w: w.rank)
    assert len(members) == 3
    generation = client.generation
    ids = {w.worker_id for w in members}

    browser.get(f"http://127.0.0.1:{port}/")
    assert browser.title.startswith("collectives")

    def all_ready(driver) -> bool:
        rows = page.rows(driver)
        return {i for i, s in rows.items() if s == "ready"} == ids and page.text(
            driver, "generation"
        ) == str(generation)

    WebDriverWait(browser, 30, poll_frequency=0.1).until(
        all_ready, f"3 ready worker rows {sorted(ids)} and generation {generation}"
    )
    # A little work, so the rows show what the workers report (tensors, ops, an error).
    client.put("dashboard/x", torch.arange(1024, dtype=torch.float32))
    client.all_reduce("dashboard/x", op="sum")
    with pytest.raises(collectives.NotFound):
        client.get("dashboard/missing", rank=0)

    def work_shown(driver) -> bool:
        stats = driver.execute_script(_STATS_JS)
        errors = driver.find_elements("css selector", "#error-rows tr[data-count]")
        return (
            len(stats) == 3
            and all(int(t) >= 1 and int(ops) >= 2 for t, ops in stats)
            and len(errors) >= 1
        )

    WebDriverWait(browser, 15, poll_frequency=0.1).until(
        work_shown, "tensors held, completed ops and the NOT_FOUND error on the page"
    )
    # A model, published once: every row shows it at the version publish returned.
    client.load_model("dashboard/mlp", factory="collectives_server.model_zoo:mlp", kwargs=MLP)
    state = {k: torch.ones_like(v) for k, v in client.state_dict("dashboard/mlp").items()}
    version = client.publish("dashboard/mlp", state)
    assert version == 2
    expected = [[f"dashboard/mlp v{version}", False]]

    def version_shown(driver) -> bool:
        shown = {i: (lag, models) for i, lag, models in driver.execute_script(_MODELS_JS)}
        return set(shown) == ids and all(v == ("", expected) for v in shown.values())

    WebDriverWait(browser, 15, poll_frequency=0.1).until(
        version_shown, f"'dashboard/mlp v{version}' in every worker row, none lagging"
    )
    # Updates arrive over the event stream, not by polling.
    WebDriverWait(browser, 10, poll_frequency=0.1).until(
        lambda d: d.find_element("id", "connection").get_attribute("data-mode") == "live",
        "the page's event stream to be live",
    )
    before = page.screenshot(browser, "before")

    # Proof that what follows is pushed to the same page, not a reload.
    browser.execute_script("window.__collectivesTestMarker = 42;")
    victim = members[1]
    assert local.owns(victim.pid), f"pid {victim.pid} is not one of this cluster's processes"
    os.kill(victim.pid, signal.SIGKILL)

    def victim_lost(driver) -> bool:
        rows = page.rows(driver)
        text = page.text(driver, "generation") or "0"
        survivors = {i for i, s in rows.items() if s == "ready"}
        return (
            rows.get(victim.worker_id) == "lost"
            and int(text) > generation
            and survivors == ids - {victim.worker_id}
        )

    WebDriverWait(browser, REFORM_S, poll_frequency=0.1).until(
        victim_lost, f"worker {victim.worker_id} shown lost and a generation after {generation}"
    )
    assert browser.execute_script("return window.__collectivesTestMarker;") == 42, (
        "the page was reloaded"
    )
    new_generation = int(page.text(browser, "generation"))
    assert page.text(browser, "world-size") == "2"
    # The page agrees with the API it reads; history rows appear when the coordinator keeps them.
    cluster = page.api_cluster(port)
    if cluster.get("history"):
        wait_until(
            lambda: browser.find_elements(
                "css selector", f'#timeline-rows tr[data-generation="{new_generation}"]'
            ),
            10,
            f"a timeline row for generation {new_generation} sealed",
        )
    # The loss is an event of its own, and the lost worker's numbers are marked stale.
    wait_until(
        lambda: browser.find_elements("css selector", '#timeline-rows tr[data-kind="lost"]'),
        10,
        "a 'lost' event in the timeline",
    )
    # Read in one script: the table is re-rendered on every update, so an element found
    # in one call may be gone by the next (a stale element reference).
    lost_text = browser.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
        f'tr[data-worker-id="{victim.worker_id}"]',
    )
    assert lost_text is not None and "lost" in lost_text, lost_text
    assert re.search(r"stale since \d\d:\d\d:\d\d", lost_text), lost_text
    after = page.screenshot(browser, "after")
    log.info(f"screenshots: {before} {after}")


# ------------------------------------------------------------ escaping (no cluster)

_HOSTILE = '<img src=x onerror="window.__pwned=1">'


class _FakeSource:
    """A fixed cluster whose strings are markup; wait_for_change never fires."""

    closed = False

    def __init__(self) -> None:
        from collectives.v1 import coordinator_pb2, status_pb2

        cluster = coordinator_pb2.Cluster(
            generation=7, formed=True, ready=True, world_size=1, version=3, status=_HOSTILE
        )
        cluster.min_workers = cluster.max_workers = 1
        status = status_pb2.WorkerStatus(
            tensors_held=2, bytes_held=3 << 20, models=[_HOSTILE], last_op=_HOSTILE
        )
        status.ops.add(kind="all_reduce", completed=5, failed=1)
        status.devices.add(device="cpu", memory_used_bytes=1 << 30, memory_total_bytes=4 << 30)
        status.recent_errors.add(
            unix_time_s=1.7e9, op_id=9, generation=7, kind="all_reduce", code="NOT_FOUND",
            message=_HOSTILE,
        )  # fmt: skip
        cluster.workers.add(
            worker_id="w<b>1</b>", rank=0, address="127.0.0.1:1", hostname=_HOSTILE, pid=1,
            state=coordinator_pb2.WORKER_STATE_READY, devices=["cpu"], status=status,
        )  # fmt: skip
        cluster.history.add(generation=7, world_size=1, members=[_HOSTILE], reason=_HOSTILE)
        self._cluster = cluster
        self._wake = threading.Event()

    def snapshot(self):
        return self._cluster

    def wait_for_change(self, after_version: int, timeout_s: float):
        self._wake.wait(timeout_s)
        return None


def test_dashboard_shows_markup_astext(browser):
    from selenium.webdriver.support.ui import WebDriverWait

    from collectives_server.coordinator.dashboard.server import DashboardServer

    dashboard = DashboardServer(_FakeSource(), port=0, refresh_s=0.5).start()
    try:
        browser.get(f"http://{dashboard.address}/")
        WebDriverWait(browser, 15, poll_frequency=0.1).until(
            lambda d: page.rows(d) == {"w<b>1</b>": "ready"}, "the fake worker row"
        )
        assert page.text(browser, "generation") == "7"
        assert page.text(browser, "status-text") == _HOSTILE
        # Found and clicked in one step in the page: the table is redrawn every refresh,
        # and an element found from here can be replaced before the click reaches it.
        browser.execute_script("document.querySelector('#worker-rows tr[data-worker-id]').click();")
        WebDriverWait(browser, 5, poll_frequency=0.1).until(
            lambda d: d.find_elements("css selector", "#worker-rows tr.details"), "the details row"
        )
        shown = browser.find_element("tag name", "main").text
        # status, host (row and details), model, last op, error (failed ops and details),
        # timeline (members, reason)
        assert shown.count(_HOSTILE) >= 5, shown
        assert browser.find_elements("css selector", "main img") == []
        assert browser.execute_script("return window.__pwned === undefined")
        page.screenshot(browser, "escaping")
    finally:
        dashboard.stop()


# ------------------------------------------------- a worker behind on a model


def _versions_cluster():
    """Two live workers, one a version behind on "mlp"; a lost one further behind."""
    from collectives.v1 import coordinator_pb2, status_pb2

    cluster = coordinator_pb2.Cluster(
        generation=4, formed=True, ready=True, world_size=2, version=11, status="ok"
    )
    workers = (
        ("w-new", 0, coordinator_pb2.WORKER_STATE_READY, {"enc": 1, "mlp": 3}),
        ("w-behind", 1, coordinator_pb2.WORKER_STATE_READY, {"enc": 1, "mlp": 2}),
        ("w-lost", -1, coordinator_pb2.WORKER_STATE_LOST, {"enc": 1, "mlp": 1}),
    )
    for i, (worker_id, rank, state, versions) in enumerate(workers):
        status = status_pb2.WorkerStatus(models=sorted(versions))
        for name in sorted(versions):
            status.model_versions.add(name=name, version=versions[name])
        cluster.workers.add(
            worker_id=worker_id, rank=rank, address=f"127.0.0.1:{7100 + i}", hostname="h",
            pid=i + 1, state=state, devices=["cpu"], status=status,
        )  # fmt: skip
    return cluster


def test_dashboard_highlights_a_worker_behind_on_a_model_version(browser):
    from selenium.webdriver.support.ui import WebDriverWait

    from collectives_server.coordinator.dashboard.server import DashboardServer

    dashboard = DashboardServer(page.FixedSource(_versions_cluster()), port=0, refresh_s=0.5)
    dashboard.start()
    try:
        page.set_viewport(browser)
        browser.get(f"http://{dashboard.address}/")
        shown = WebDriverWait(browser, 15, poll_frequency=0.1).until(
            lambda d: (rows := d.execute_script(_MODELS_JS)) and len(rows) == 3 and rows,
            "3 worker rows with their models",
        )
        by_id = {worker_id: (lagging, models) for worker_id, lagging, models in shown}
        assert by_id == {
            "w-new": ("", [["enc v1", False], ["mlp v3", False]]),
            "w-behind": ("mlp", [["mlp v2", True], ["enc v1", False]]),  # lagging first
            # Lost: its last status is old by nature, not a worker lagging now.
            "w-lost": ("", [["enc v1", False], ["mlp v1", False]]),
        }, by_id
        # The highlight is visible: the lagging model's colours are not a plain one's.
        colours = browser.execute_script(
            "const row = document.querySelector('tr[data-worker-id=\"w-behind\"]');"
            "return [...row.querySelectorAll('td.models .model')].map(m => {"
            "  const s = getComputedStyle(m); return [s.backgroundColor, s.color]; });"
        )
        assert colours[0] != colours[1], colours
        lagging = browser.find_element("css selector", "td.models .model.lagging")
        assert "behind v3" in lagging.get_attribute("title")
        # The details list every model, the lagging one with the version it is behind.
        browser.execute_script("document.querySelector('tr[data-worker-id=\"w-behind\"]').click();")
        details = WebDriverWait(browser, 5, poll_frequency=0.1).until(
            lambda d: d.execute_script(
                "const r = document.querySelector('#worker-rows tr.details');"
                "return r ? r.textContent : null;"
            ),
            "the details row",
        )
        assert "enc v1, mlp v2 (behind v3)" in details, details
        page.fits(browser)
        page.screenshot(browser, "model-versions")
    finally:
        dashboard.stop()
