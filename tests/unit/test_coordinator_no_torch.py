"""A coordinator that hosts no rendezvous store never imports torch, not even to
print torch's version in ``collectives_build_info`` on a metrics scrape."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent(
    """
    import json, sys, urllib.request
    from collectives_server.coordinator.daemon import Coordinator, CoordinatorConfig

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

    coordinator = Coordinator(CoordinatorConfig(min_workers=1, max_workers=1, metrics_port=0))
    coordinator.start()
    try:
        before = rss_kib()
        url = f"http://{coordinator.metrics_address}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        line = next(l for l in body.splitlines() if l.startswith("collectives_build_info"))
        print(json.dumps({
            "torch_loaded": "torch" in sys.modules,
            "build_info": line,
            "rss_before_kib": before,
            "rss_after_kib": rss_kib(),
        }))
    finally:
        coordinator.stop()
    """
)


def test_a_metrics_scrape_does_not_load_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["torch_loaded"] is False, probe
    import importlib.metadata

    assert f'torch="{importlib.metadata.version("torch")}"' in probe["build_info"]
    # torch alone would add well over 100 MiB; the scrape itself adds almost nothing.
    assert probe["rss_after_kib"] - probe["rss_before_kib"] < 32 * 1024, probe
