"""Row 7: coordinator scale with N simulated workers heartbeating at 1 Hz.

A real coordinator process (``python -m collectives_server coordinator
--min-workers N --max-workers N --heartbeat 1 --lease 5``) is sent N
``Register`` calls, then one ``Heartbeat`` per worker per second (each with a
typical ``WorkerStatus``: ops counters, a device, versions, memory readings
that change every beat), issued as gRPC futures from one scheduler thread and
spread evenly over each second. Over measured windows the coordinator's CPU
time is read from ``/proc/<pid>/stat`` (utime + stime) before and after.

- CPU: fraction of one core vs the budget of acceptance 2 (1,000 workers
  < 20 % of a core), scaled linearly to N (200 us of CPU per heartbeat);
- ``GetCluster`` p50 latency vs one empty gRPC round trip to the same process;
- the ``Cluster`` message size vs a budget of 400 B per worker (the unit test
  ``tests/unit/test_cluster_size_budget.py`` holds 10,000 workers to 4 MB).

What bounds the CPU (measured, 2-core VM): ~700 us per heartbeat remain with
no status at all (grpcio's Python unary path: completion queue, thread pool
hand-off, GIL), ~250 us more for a changing status (parse, ``status_key``'s
deterministic re-serialisation); and ``Membership.heartbeat`` does O(N) work
per beat (``_finish`` -> ``_decide`` and ``_compute_status`` scan every
worker; cProfile: 2,000 registrations + heartbeats take 14 s), which dominates
from ~1,000 workers on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc, status_pb2

from .anchors import grpc_empty_rtt, percentile
from .core import BenchContext, Row, Stat, stat_of

NAME = "coordinator"
CORE_BUDGET_1000 = 0.20  # acceptance 2: 1,000 workers < 20 % of one core
BYTES_PER_WORKER_BUDGET = 400
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def typical_status(i: int, beat: int) -> status_pb2.WorkerStatus:
    """What a busy CPU worker reports in each heartbeat (memory readings change every beat)."""
    return status_pb2.WorkerStatus(
        tensors_held=12,
        bytes_held=64 << 20,
        models=["mlp"],
        ops=[
            status_pb2.OpCount(kind=k, completed=100 + beat, failed=0)
            for k in ("put", "get", "all_reduce", "forward")
        ],
        last_op="all_reduce",
        last_op_latency_s=0.0012,
        devices=[
            status_pb2.DeviceStatus(
                device="cpu", memory_used_bytes=(1 << 30) + beat * 4096, memory_total_bytes=16 << 30
            )
        ],
        package_version="0.1.0",
        torch_version="2.13.0",
        backend_version="gloo",
        bytes_received=1 << 30,
        bytes_sent=1 << 30,
        process_rss_bytes=(2 << 30) + beat * 4096 + i,
        host_memory_total_bytes=64 << 30,
        host_memory_available_bytes=(32 << 30) - beat * 4096,
        data_collectives=10 + beat,
    )


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    # After the ")" of comm: field 3 is state, so utime (14) and stime (15) are at 11 and 12.
    return (int(fields[11]) + int(fields[12])) / _TICKS


class _Coordinator:
    def __init__(self, n: int) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "collectives_server",
                "coordinator",
                "--port",
                "0",
                "--min-workers",
                str(n),
                "--max-workers",
                str(n),
                "--heartbeat",
                "1",
                "--lease",
                "5",
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.address = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if not self.address:
            self.close()
            raise RuntimeError("the coordinator did not start")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Heartbeats:
    """Sends one heartbeat per worker per second, spread over the second, as futures."""

    def __init__(self, stub, ids: list[str]) -> None:
        self._stub = stub
        self._ids = ids
        self._stop = threading.Event()
        self.sent = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)
        self._thread.start()

    def _done(self, future) -> None:
        with self._lock:
            if future.exception() is None:
                self.sent += 1
            else:
                self.failed += 1

    def _run(self) -> None:
        n = len(self._ids)
        start = time.perf_counter()
        beat = 0
        while not self._stop.is_set():
            for i, worker_id in enumerate(self._ids):
                due = start + beat + i / n
                delay = due - time.perf_counter()
                if delay > 0 and self._stop.wait(delay):
                    return
                request = coordinator_pb2.HeartbeatRequest(
                    worker_id=worker_id, status=typical_status(i, beat)
                )
                self._stub.Heartbeat.future(request, timeout=5).add_done_callback(self._done)
            beat += 1

    def count(self) -> int:
        with self._lock:
            return self.sent

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _measure(n: int, windows: int, window_s: float) -> dict:
    coordinator = _Coordinator(n)
    try:
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            ids = [
                stub.Register(
                    coordinator_pb2.RegisterRequest(
                        address=f"127.0.0.1:{20000 + i}",
                        hostname=f"sim-{i % 64}",
                        pid=100000 + i,
                        devices=["cpu"],
                        backend="gloo",
                        version="0.1.0",
                    ),
                    timeout=10,
                ).worker_id
                for i in range(n)
            ]
            beats = _Heartbeats(stub, ids)
            try:
                time.sleep(2.0)  # settle: sealing, the first round of statuses
                fractions, per_beat = [], []
                for _ in range(windows):
                    cpu0, sent0, t0 = _cpu_seconds(coordinator.proc.pid), beats.count(), time.time()
                    time.sleep(window_s)
                    cpu1, sent1, t1 = _cpu_seconds(coordinator.proc.pid), beats.count(), time.time()
                    fractions.append((cpu1 - cpu0) / (t1 - t0))
                    per_beat.append((cpu1 - cpu0) / max(sent1 - sent0, 1) * 1e6)
                latencies, size = [], 0
                for _ in range(30):
                    started = time.perf_counter()
                    cluster = stub.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=10)
                    latencies.append(time.perf_counter() - started)
                    size = cluster.ByteSize()
                rtt = grpc_empty_rtt(coordinator.address, 30)
            finally:
                beats.stop()
            return {
                "fractions": fractions,
                "per_beat_us": per_beat,
                "getcluster": latencies,
                "rtt": rtt,
                "size": size,
                "failed": beats.failed,
            }
    finally:
        coordinator.close()


def _const(value: float, unit: str) -> Stat:
    return Stat(value, value, value, unit, 1)


def run(ctx: BenchContext) -> list[Row]:
    sizes = ctx.sizes([100, 1000], [100, 300])
    windows = 3 if ctx.quick else ctx.repeats
    window_s = 2.0 if ctx.quick else 5.0
    rows: list[Row] = []
    for n in sizes:
        m = _measure(n, windows, window_s)
        budget = CORE_BUDGET_1000 * n / 1000
        per_beat = stat_of(m["per_beat_us"], "us")
        rows.append(
            Row(
                group="7 coordinator",
                what=f"{n} workers at 1 Hz: coordinator CPU (fraction of one core)",
                service=stat_of(m["fractions"], "core"),
                anchor_name=f"budget: 20 % of a core per 1,000 workers, x {n}/1000",
                anchor=_const(budget, "core"),
                target="<= 1.0",
                note=f"CPU per heartbeat {per_beat.text()}; failed heartbeats {m['failed']}; "
                "bound: grpcio unary overhead + O(N) membership work per heartbeat",
                extra={"workers": n, "cpu_per_heartbeat_us": per_beat.median},
            )
        )
        p50 = percentile(m["getcluster"], 50)
        rows.append(
            Row(
                group="7 coordinator",
                what=f"{n} workers: GetCluster p50",
                service=_const(p50, "s"),
                anchor_name="empty gRPC round trip p50, same process",
                anchor=_const(percentile(m["rtt"], 50), "s"),
                note=f"p99 {percentile(m['getcluster'], 99) * 1e3:.3g} ms; message {m['size']} B",
                extra={"workers": n, "bytes": m["size"]},
            )
        )
        rows.append(
            Row(
                group="7 coordinator",
                what=f"{n} workers: Cluster message size",
                service=_const(m["size"], "B"),
                anchor_name=f"budget {BYTES_PER_WORKER_BUDGET} B per worker",
                anchor=_const(BYTES_PER_WORKER_BUDGET * n, "B"),
                target="<= 1.0",
                extra={"workers": n, "bytes_per_worker": m["size"] / n},
            )
        )
    return rows
