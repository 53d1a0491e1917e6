"""Row 8: peak memory of a worker receiving a 1 GiB tensor.

The worker's peak RSS (``VmHWM`` in ``/proc/<pid>/status``) is reset when the
kernel allows it (``echo 5 > /proc/<pid>/clear_refs``), its RSS read before the
put, and ``VmHWM`` after: (peak - RSS before) / tensor bytes is the ratio,
against the tensor size itself. Target <= 1.3.
"""

from __future__ import annotations

from pathlib import Path

import torch

import collectives

from .core import BenchContext, GiB, MiB, Row, Stat, shared_cluster, stat_of

NAME = "memory"


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def _reset_peak(pid: int) -> bool:
    """Resets the process's VmHWM to its current RSS (Linux >= 4.0); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def run(ctx: BenchContext) -> list[Row]:
    nbytes = 256 * MiB if ctx.quick else 1 * GiB
    repeats = 2 if ctx.quick else 3
    if not Path("/proc/self/status").exists():
        raise RuntimeError("row 'memory' needs Linux /proc")
    growth_mib = []
    reset_ok = True
    with collectives.connect(shared_cluster(2), timeout=120) as cluster:
        pid = next(w for w in cluster.workers() if w.rank == 0).pid
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        name = "bench/memory"
        # A first small put warms the worker's code paths (imports, channel) outside the window.
        cluster.put(name, torch.ones(1024), rank=0)
        cluster.delete(name, rank=0)
        for _ in range(repeats):
            reset_ok = _reset_peak(pid) and reset_ok
            before = _status_kib(pid, "VmRSS")
            cluster.put(name, t, rank=0, timeout=600)
            peak = _status_kib(pid, "VmHWM")
            growth_mib.append((peak - before) * 1024 / MiB)
            cluster.delete(name, rank=0)
    size_mib = nbytes / MiB
    service = stat_of(growth_mib, "MiB")
    return [
        Row(
            group="8 memory",
            what=f"worker peak RSS growth, put {nbytes // MiB} MiB",
            service=service,
            anchor_name="the tensor's size",
            anchor=Stat(size_mib, size_mib, size_mib, "MiB", 1),
            target="<= 1.3",
            note=""
            if reset_ok
            else "VmHWM could not be reset (clear_refs refused): peak is since worker start",
            extra={"tensor_bytes": nbytes, "hwm_reset": reset_ok, "growth_mib": growth_mib},
        )
    ]
