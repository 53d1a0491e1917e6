"""The headless Chromium the dashboard tests drive (``browser`` fixture).

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package.
Outside CI the tests skip without them; in CI (``CI=true``) they fail instead, so
the browser check can never silently stop running there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MISSING = "needs /usr/bin/chromium and chromedriver: apt-get install chromium chromium-driver"


def _browser_available() -> str | None:
    """None when the browser test can run, else why not."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        return MISSING
    try:
        import selenium  # noqa: F401
    except ImportError:
        return (
            "needs the selenium package: make install (or pip install -c constraints.txt selenium)"
        )
    return None


@pytest.fixture
def browser(tmp_path: Path) -> Iterator:
    reason = _browser_available()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the browser test cannot run: {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp_path)
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-quic",
        "--disable-sync",
        "--window-size=1600,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # to check for JS errors
    # Both paths are given, so selenium-manager (which would download) has nothing to do.
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
