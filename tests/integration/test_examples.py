"""The README's examples run as written against a local cluster and check themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", ["inference_fanout.py", "train_remote.py"])
def test_example_runs_against_a_running_cluster(cluster3_address: str, script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--coordinator", cluster3_address],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal" in done.stdout
