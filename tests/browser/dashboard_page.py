"""Helpers for the dashboard's browser tests: reading the page, screenshots, the viewport."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"

ROWS_JS = """
return Array.from(document.querySelectorAll('#worker-rows tr[data-worker-id]'))
  .map(r => [r.dataset.workerId, r.dataset.state]);
"""


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"dashboard-{name}.png"
    # The whole page, not just the window: grow the window to the document.
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1600, max(1000, int(height) + 40))
    assert driver.save_screenshot(str(path)), f"could not save {path}"
    return path


def rows(driver) -> dict[str, str]:
    return dict(driver.execute_script(ROWS_JS))


def text(driver, element_id: str) -> str:
    return driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.textContent : null;",
        element_id,
    )


def api_cluster(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/cluster", timeout=10) as r:
        return json.load(r)


FITS_JS = """
const wraps = Array.from(document.querySelectorAll('.table-wrap'));
return [document.documentElement.scrollWidth, window.innerWidth, window.innerHeight,
        wraps.filter(w => w.scrollWidth > w.clientWidth).map(w => w.querySelector('table').id)];
"""


def fits(driver) -> None:
    """No horizontal scroll: not the page, and no table scrolled inside its box."""
    scroll_width, inner_width, inner_height, scrolled = driver.execute_script(FITS_JS)
    assert (inner_width, inner_height) == (1280, 800), "the viewport is not 1280x800"
    assert scroll_width <= inner_width, f"page is {scroll_width} px wide in {inner_width}"
    assert scrolled == [], f"tables that scroll sideways: {scrolled}"


def set_viewport(driver, width: int = 1280, height: int = 800) -> None:
    """The page's viewport, exactly (the window's outer size is not)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


class FixedSource:
    """A dashboard source serving one fixed Cluster; ``wait_for_change`` never fires."""

    closed = False

    def __init__(self, cluster) -> None:
        self._cluster = cluster
        self._wake = threading.Event()

    def snapshot(self):
        return self._cluster

    def wait_for_change(self, after_version: int, timeout_s: float):
        self._wake.wait(timeout_s)
        return None
