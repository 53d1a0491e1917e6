"""A drain on the dashboard, in a real headless Chromium: the spare counted in the
status card, the drain's event in the timeline (who handed which rank to whom,
what moved), and no drain shown in progress once it ended."""

from __future__ import annotations

import pytest
import torch
from dashboard_page import fits, set_viewport
from helpers import wait_until
from launcher import free_port

_EVENTS_JS = """
return Array.from(document.querySelectorAll('#timeline-rows tr'))
  .map(r => [r.dataset.kind, r.textContent]);
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_drain_shows_in_the_timeline(browser, fresh_cluster, gen) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    _, cluster = fresh_cluster(2, "--spares", "1", "--dashboard-port", str(port))
    wait_until(lambda: any(w.state == "spare" for w in cluster.workers()), 30, "the spare")
    set_viewport(browser)
    browser.get(f"http://127.0.0.1:{port}/")
    WebDriverWait(browser, 30, poll_frequency=0.25).until(
        lambda d: "1 spare" in d.find_element("id", "counts").text, "the spare counted"
    )
    cluster.put("dash/t", torch.randn(1 << 20, generator=gen), rank=1)  # 4 MiB
    drained = cluster.workers()[1]
    report = cluster.drain(drained.address)

    def drain_event(driver):
        rows = [text for kind, text in driver.execute_script(_EVENTS_JS) if kind == "drained"]
        return rows[0] if rows else None

    row = WebDriverWait(browser, 30, poll_frequency=0.25).until(
        drain_event, "the drain's event in the timeline"
    )
    assert f"{drained.worker_id} at {drained.address} (rank 1)" in row, row
    assert f"onto {report.successor_id} at {report.successor}" in row, row
    assert "1 tensors, 4.0 MiB" in row, row
    assert not browser.find_element("id", "drain").is_displayed()
    fits(browser)
    logged = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert logged == [], f"the page logged errors: {logged}"
