"""The end-of-run summary of skipped tests: grouped by what they lack, with the
command that installs it."""

from __future__ import annotations

from skip_groups import skip_summary


def test_skips_are_grouped_by_the_tool_they_lack() -> None:
    lines = skip_summary(
        [
            "needs /usr/bin/chromium and chromedriver: apt-get install chromium chromium-driver",
            "needs /usr/bin/chromium and chromedriver: apt-get install chromium chromium-driver",
            "etcd is not installed (Debian: apt-get install etcd-server)",
            "no writable /dev/shm",
        ]
    )
    assert lines == [
        "SKIPPED: browser tests (no chromium/chromedriver), 2 test(s): "
        "sudo apt-get install -y chromium chromium-driver",
        "SKIPPED: etcd / HA coordinator tests (no etcd), 1 test(s): "
        "sudo apt-get install -y --no-install-recommends etcd-server",
        "SKIPPED: 1 test(s): no writable /dev/shm",
    ]


def test_no_skips_no_lines() -> None:
    assert skip_summary([]) == []
