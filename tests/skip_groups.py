"""Skipped tests grouped by the tool they lack, with the command that installs it.

``tests/conftest.py`` prints these lines at the end of every run, so a local run
that skipped the browser, Prometheus or etcd tests says so and says how to run
them. ``.ci/run`` installs every tool named here, and with ``CI=true`` those tests
fail instead of skipping (``helpers.required_binary``, ``tests/browser/conftest.py``).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

__all__ = ["SKIP_GROUPS", "SkipGroup", "skip_summary"]


class SkipGroup(NamedTuple):
    """Tests that skip for want of one tool, and the command that installs it."""

    name: str  # which tests, and what they lack
    reason_word: str  # a word every skip reason of the group contains (lower case)
    install: str


# What a local run may lack; the first word a reason contains picks its group.
SKIP_GROUPS = (
    SkipGroup(
        "browser tests (no chromium/chromedriver)",
        "chromium",
        "sudo apt-get install -y chromium chromium-driver",
    ),
    SkipGroup("browser tests (no selenium)", "selenium", "make install"),
    SkipGroup(
        "Prometheus tests (no prometheus)",
        "prometheus",
        "sudo apt-get install -y --no-install-recommends prometheus",
    ),
    SkipGroup(
        "etcd / HA coordinator tests (no etcd)",
        "etcd",
        "sudo apt-get install -y --no-install-recommends etcd-server",
    ),
    SkipGroup("TCP byte counts (no ss)", "needs ss", "sudo apt-get install -y iproute2"),
    SkipGroup(
        "kustomize check (no kubectl)",
        "kubectl",
        "install kubectl: https://kubernetes.io/docs/tasks/tools/",
    ),
)


def skip_summary(reasons: list[str]) -> list[str]:
    """One line per group of skipped tests: what they lack and how to install it;
    skips no group explains are counted by reason."""
    grouped: Counter[SkipGroup] = Counter()
    others: Counter[str] = Counter()
    for reason in reasons:
        group = next((g for g in SKIP_GROUPS if g.reason_word in reason.lower()), None)
        if group is None:
            others[reason] += 1
        else:
            grouped[group] += 1
    lines = [
        f"SKIPPED: {group.name}, {count} test(s): {group.install}"
        for group, count in grouped.items()
    ]
    lines += [f"SKIPPED: {count} test(s): {reason}" for reason, count in others.items()]
    return lines
