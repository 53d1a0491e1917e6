"""The dashboard shows which coordinator of an HA set leads, and follows a failover.

Two coordinators (in this process) share a real etcd; the page is opened on the
standby. It names the first leader; when that one stops (and resigns), the
standby takes over and its own page names it. Each coordinator's
``collectives_coordinator_leader`` metric says the same.
"""

from __future__ import annotations

import urllib.request

import dashboard_page as page
from etcd_server import EtcdServer
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from collectives_server.coordinator.daemon import Coordinator, CoordinatorConfig


def _leader_metric(coordinator: Coordinator) -> float:
    url = f"http://{coordinator.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "collectives_coordinator_leader":
            return family.samples[0].value
    raise AssertionError("no collectives_coordinator_leader metric")


def _start(etcd: EtcdServer) -> Coordinator:
    config = CoordinatorConfig(
        min_workers=1,
        max_workers=1,
        store=etcd.url,
        cluster_name="dashboard",
        leader_ttl_s=1,
        dashboard_port=0,
        metrics_port=0,
    )
    return Coordinator(config).start()


def test_the_page_names_the_leader_and_follows_a_failover(browser, tmp_path) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    etcd = EtcdServer(tmp_path / "etcd")
    first = _start(etcd)
    second: Coordinator | None = None
    try:
        wait_until(lambda: first.cluster().leader == first.address, 10, "the first to lead")
        second = _start(etcd)
        wait_until(lambda: second.cluster().leader == first.address, 10, "the standby to follow")
        assert (_leader_metric(first), _leader_metric(second)) == (1, 0)
        page.set_viewport(browser)
        browser.get(f"http://{second.dashboard_address}/")

        def hint_names(address: str) -> bool:
            return f"leader {address}" in (page.text(browser, "version") or "")

        WebDriverWait(browser, 15, poll_frequency=0.1).until(
            lambda d: hint_names(first.address), f"the standby's page to name {first.address}"
        )
        first.stop()  # resigns: the standby leads within a poll
        WebDriverWait(browser, 15, poll_frequency=0.1).until(
            lambda d: hint_names(second.address), f"the page to name {second.address}"
        )
        assert _leader_metric(second) == 1
        assert page.api_cluster(int(second.dashboard_address.rsplit(":", 1)[1]))["store"] == "etcd"
        page.fits(browser)
        page.screenshot(browser, "ha-leader")
    finally:
        first.stop()
        if second is not None:
            second.stop()
        etcd.stop()
