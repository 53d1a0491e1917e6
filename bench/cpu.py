"""CPU seconds of whole processes, from ``/proc`` (Linux): what bounds a throughput row.

A row that misses a throughput target on a small machine should say whether any
design could meet it there. :class:`CpuMeter` reads the user + system CPU time
(every thread) of a set of processes before and after a span; the CPU they
spent per op, against the machine's cores, gives the most ops per second those
processes could ever reach on it (``cores / cpu_per_op``), whatever they
overlap or fuse.

:func:`tree` finds a process and all its descendants (a ``collectives-server
local`` launcher: its coordinator and workers). A process that exits during
the span is counted up to its last reading (its figure is then a lower bound).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["available", "cpu_seconds", "tree", "CpuMeter"]

_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available() -> bool:
    """Whether per-process CPU times can be read here (``/proc/<pid>/stat``)."""
    return (_PROC / "self" / "stat").is_file()


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 first), or None
    when the process is gone. The name is in parentheses and may hold spaces."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """User + system CPU seconds (all threads, not reaped children) of each live pid."""
    out = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:  # utime, stime: fields 14, 15 (1-based) of the line
            out[pid] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def tree(root: int) -> list[int]:
    """``root`` (live or not) and every live descendant of it (parent links from
    ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:  # ppid: field 4
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


class CpuMeter:
    """CPU seconds each of ``pids`` spent between :meth:`start` and :meth:`stop` calls,
    summed over every start/stop span."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.pids = list(pids)
        self.spent: dict[int, float] = dict.fromkeys(self.pids, 0.0)
        self._started: dict[int, float] = {}

    def start(self) -> None:
        self._started = cpu_seconds(self.pids)

    def stop(self) -> dict[int, float]:
        """Adds this span to :attr:`spent`; returns the span's CPU seconds per pid."""
        now = cpu_seconds(self.pids)
        span = {pid: now[pid] - t for pid, t in self._started.items() if pid in now}
        for pid, seconds in span.items():
            self.spent[pid] += seconds
        self._started = {}
        return span
