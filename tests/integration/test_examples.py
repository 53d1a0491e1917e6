"""The README's examples run as written against a local cluster and check themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "flags"),
    [
        ("inference_fanout.py", []),
        ("train_remote.py", []),
        # Small counts: a few seconds; the summary's checks are the example's own.
        ("weight_sync.py", ["--publishes", "8", "--calls", "12"]),
    ],
)
def test_example_runs_against_a_running_cluster(
    cluster3_address: str, script: str, flags: list[str]
) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--coordinator", cluster3_address, *flags],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal" in done.stdout


def test_ha_failover_example_starts_etcd_and_survives_its_leader_kill() -> None:
    """examples/ha_failover.py brings its own etcd, coordinators and workers."""
    from etcd_server import etcd_binary

    etcd_binary()  # skips without etcd (fails with CI=true)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "ha_failover.py"), "--seconds", "2"],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "leads after" in done.stdout and "equal to torch's" in done.stdout
