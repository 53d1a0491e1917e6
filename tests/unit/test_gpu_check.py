"""``make gpu-check`` on a machine without a GPU: one line, exit 0 (CI has no GPU).

The checks themselves run on GPUs; ``python -m bench.gpu_check --cpu`` runs the
same script on CPU workers by hand (minutes: it is not part of the suite).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: make gpu-check runs")
def test_without_a_gpu_it_says_so_in_one_line_and_succeeds() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "sees no CUDA GPU" in lines[0], done.stdout
