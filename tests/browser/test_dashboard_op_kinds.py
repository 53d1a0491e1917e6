"""The dashboard's operator view under load, in a real headless Chromium at 1280x800.

A named client (``COLLECTIVES_CLIENT_NAME=dash-load``) runs small all_reduces on 2
workers, about 1 % of which fail (a missing tensor). The page must show:

* the ops by kind: the cluster's ``all_reduce`` row with a rate above 0 and its
  p50/p99, and collective bytes moved;
* the failures as one aggregated row (kind, code, message) whose count follows
  the client's failures, with the client's name;
* the client in the clients table;
* on a fresh load, the last known rates in the first paint (not a dash);

and nothing may scroll sideways. The screenshot is
``artifacts/dashboard-op-kinds-1280x800.png``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dashboard_page import ARTIFACTS, fits, set_viewport
from launcher import free_port

import collectives

FAIL_EVERY = 100  # one failing op in 100
CLIENT = "dash-load"

_KINDS_JS = """
const r = document.querySelector('#kind-table tr[data-kind="all_reduce"]');
return r ? [Number(r.dataset.rate), Number(r.dataset.p50), Number(r.dataset.p99),
            Number(r.dataset.completed), Number(r.dataset.failed), Number(r.dataset.bytesIn),
            r.textContent] : null;
"""
_ERRORS_JS = """
return Array.from(document.querySelectorAll('#error-rows tr[data-count]'))
  .map(r => [r.dataset.kind, r.dataset.code, Number(r.dataset.count), r.dataset.client,
             r.textContent]);
"""
_CLIENTS_JS = """
return Array.from(document.querySelectorAll('#client-rows tr[data-client-name]'))
  .map(r => r.dataset.clientName);
"""
# Installed before the page's scripts: what the workers' rows showed at the first
# render (app.js sets body[data-version] right after rendering a snapshot).
_FIRST_PAINT_JS = """
window.__firstPaint = null;
new MutationObserver((changes, observer) => {
  if (!document.body || !document.body.dataset.version) return;
  observer.disconnect();
  window.__firstPaint = Array.from(
    document.querySelectorAll('#worker-rows tr[data-worker-id] td.rate .rate-num'))
    .map(n => n.textContent);
}).observe(document, {attributes: true, subtree: true, attributeFilter: ['data-version']});
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_per_kind_rates_and_aggregated_errors_at_1280_under_load(
    browser, fresh_cluster, monkeypatch, uname, gen
):
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    local, _ = fresh_cluster(2, "--dashboard-port", str(port))
    monkeypatch.setenv("COLLECTIVES_CLIENT_NAME", CLIENT)
    client = collectives.connect(local.address, timeout=30)
    name, missing = uname("load"), uname("only0")
    client.put(name, torch.randn(1024, generator=gen))
    stop = threading.Event()
    counts = {"ok": 0, "failed": 0}
    problems: list[BaseException] = []

    def load() -> None:
        deadline = time.monotonic() + 150.0
        i = 0
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                i += 1
                if i % FAIL_EVERY == 0:
                    try:
                        client.all_reduce(missing, timeout=10.0)
                    except collectives.NotFound:
                        counts["failed"] += 1
                else:
                    client.all_reduce(name, op="max", timeout=10.0)
                    counts["ok"] += 1
        except BaseException as e:  # reported by the test thread
            problems.append(e)

    loader = threading.Thread(target=load, name="dashboard-kinds-load", daemon=True)
    loader.start()
    try:
        set_viewport(browser)
        browser.get(f"http://127.0.0.1:{port}/")

        def busy(driver):
            # Errors first: the kinds, read after them, count at least those failures.
            errors = [e for e in driver.execute_script(_ERRORS_JS) if missing in e[4]]
            kinds = driver.execute_script(_KINDS_JS)
            shown = (
                kinds is not None
                and kinds[0] > 0
                and 0 < kinds[1] <= kinds[2]
                and kinds[5] > 0
                and len(errors) == 1
                and errors[0][2] >= 3
                and CLIENT in driver.execute_script(_CLIENTS_JS)
            )
            return (kinds, errors) if shown else None

        kinds, errors = WebDriverWait(browser, 90, poll_frequency=0.25).until(
            busy, "all_reduce's rate/p50/p99 and 3+ failures in one row with the client"
        )
        assert not problems, problems
        kind, code, count, who, _ = errors[0]
        assert (kind, code) == ("all_reduce", "NOT_FOUND")
        assert who.startswith(f"{CLIENT} (ipv"), who
        # One row however many failures; its count is what the client saw (so far).
        assert count <= counts["failed"] and count >= 3
        # About 1 % of the ops failed, as the counts say.
        assert kinds[4] >= 3 and kinds[3] >= (FAIL_EVERY - 1) * 3
        fits(browser)
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / "dashboard-op-kinds-1280x800.png"
        assert browser.save_screenshot(str(path)), f"could not save {path}"

        # A fresh load: the first render already shows the rates the workers reported.
        browser.execute_cdp_cmd(
            "Page.addScriptToEvaluateOnNewDocument", {"source": _FIRST_PAINT_JS}
        )
        browser.get(f"http://127.0.0.1:{port}/")
        first = WebDriverWait(browser, 30, poll_frequency=0.1).until(
            lambda d: d.execute_script("return window.__firstPaint;"), "the first render"
        )
        dash = "\u2013"  # what a cell without a value shows
        assert len(first) == 2 and all(r not in ("", dash) and float(r) > 0 for r in first), first
        fits(browser)
        logged = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert logged == [], f"the page logged errors: {logged}"
    finally:
        stop.set()
        loader.join(timeout=15.0)
        client.close()
    assert not loader.is_alive(), "the load thread did not stop"
    assert not problems, problems
