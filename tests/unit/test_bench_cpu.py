"""bench/cpu.py against real processes, and the CPU-per-op figures of row 4b."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import cpu
from bench.concurrent_clients import ClientRound, ConcurrentResult

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs /proc/<pid>/stat (Linux)")

# A child that starts a grandchild (both wait on their stdin), prints the grandchild's
# pid once it has started up, and, when asked, burns ``seconds`` of CPU and says so.
# At EOF it closes the grandchild's stdin and reaps it before exiting itself, so once
# the test has reaped the child, neither process is left.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
seconds = float(sys.stdin.readline())
started = time.process_time()
while time.process_time() - started < seconds:
    pass
print("spun", flush=True)
sys.stdin.read()
child.stdin.close()
child.wait(30)
"""


def _start() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    grandchild = int(proc.stdout.readline())
    return proc, grandchild


def test_tree_finds_children_and_grandchildren_and_meter_counts_cpu() -> None:
    proc, grandchild = _start()
    try:
        assert sorted(cpu.tree(proc.pid)) == sorted([proc.pid, grandchild])
        assert set(cpu.tree(grandchild)) == {grandchild}
        meter = cpu.CpuMeter([proc.pid, grandchild])
        meter.start()
        began = time.monotonic()
        proc.stdin.write("0.3\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "spun"
        wall = time.monotonic() - began
        span = meter.stop()
        tick = 1.0 / cpu._TICK
        assert 0.3 - 2 * tick <= span[proc.pid] <= wall + 2 * tick
        assert span[grandchild] <= 2 * tick  # started up before the span: it only waits
        assert meter.spent == span
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0  # after reaping the grandchild
    assert cpu.cpu_seconds([proc.pid, grandchild]) == {}
    assert cpu.tree(proc.pid) == [proc.pid]  # a gone root is still reported as asked


def test_meter_skips_processes_that_exit() -> None:
    proc, grandchild = _start()
    meter = cpu.CpuMeter([proc.pid, grandchild])
    meter.start()
    proc.stdin.write("0\n")
    proc.stdin.close()
    assert proc.wait(30) == 0  # after reaping the grandchild
    assert meter.stop() == {}
    assert meter.spent == {proc.pid: 0.0, grandchild: 0.0}


def test_cpu_per_op_and_ceiling() -> None:
    rounds = [[ClientRound(300, 0.0, 1.0, (0.003,))], [ClientRound(100, 2.0, 2.5, (0.005,))]]
    result = ConcurrentResult(
        1,
        2,
        4,
        rounds,
        checks=1,
        client_cpu_s=0.2,
        server_cpu_s={"rank 0": 0.4, "rank 1": 0.2},
    )
    assert result.cpu_per_op_s == pytest.approx(0.8 / 400)
    assert result.cpu_ceiling(2) == pytest.approx(2 / (0.8 / 400))
    assert result.cpu_breakdown() == "client 0.50 ms, rank 0 1.00 ms, rank 1 0.50 ms"
    assert result.as_extra()["server_cpu_s"] == {"rank 0": 0.4, "rank 1": 0.2}
