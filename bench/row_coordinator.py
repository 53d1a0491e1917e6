"""Row 7: coordinator scale with N simulated workers heartbeating at 1 Hz.

A real coordinator process (``python -m collectives_server coordinator
--min-workers N --max-workers N --heartbeat 1 --lease 5``) is sent N
``Register`` calls; then every simulated worker opens its own connection and
``HeartbeatStream``, as the worker daemon does, and sends one heartbeat per
second on it (each with a typical ``WorkerStatus``: ops counters, a device,
versions, memory readings, all changing every beat), spread evenly over each
second, asking for an answer as the daemon does (first beat, then one in 30).
Over measured windows the coordinator's CPU time is read from
``/proc/<pid>/stat`` (utime + stime) before and after.

- CPU: fraction of one core vs the budget (1,000 workers
  < 20 % of a core), scaled linearly to N (200 us of CPU per heartbeat);
- ``GetCluster`` p50 latency vs one empty gRPC round trip to the same process;
- the ``Cluster`` message size vs a budget of 400 B per worker (the unit test
  ``tests/unit/test_cluster_size_budget.py`` holds 10,000 workers to 4 MB).

What bounds the CPU is waking grpcio's threads, not the coordinator's own work
per heartbeat; the daemons therefore turn grpc's event-engine endpoints off on
import (``collectives_server.GRPC_EXPERIMENTS``, kept when the user exported a
value). The profiles: docs/perf-log.md, "Coordinator CPU per heartbeat" and
"gRPC without its EventEngine".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time

import grpc

from collectives.v1 import coordinator_pb2, coordinator_pb2_grpc, status_pb2
from collectives_server.rpc.server import GRPC_OPTIONS
from collectives_server.worker.heartbeats import ReplySchedule, reply_interval_s

from .anchors import grpc_empty_rtt, percentile
from .core import BenchContext, Row, Stat, stat_of

NAME = "coordinator"
CORE_BUDGET_1000 = 0.20  # the target: 1,000 workers < 20 % of one core
BYTES_PER_WORKER_BUDGET = 400
HEARTBEAT_S = 1.0
LEASE_S = 5.0
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
                str(HEARTBEAT_S),
                "--lease",
                str(LEASE_S),
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
    """N simulated workers, each beating once a second on its own HeartbeatStream.

    What the coordinator sees is what real worker daemons send: one connection and
    one HeartbeatStream per worker, a ``typical_status`` that changes every beat,
    and ``want_reply`` on the beats the daemon's :class:`ReplySchedule` picks (the
    first, then one in ``REPLY_EVERY_BEATS``), beats spread evenly over each second.
    They are driven by one asyncio loop in a thread rather than by N copies of the
    daemon's threaded client, which on a 2-core machine would take the cores from
    the coordinator being measured (grpcio wakes each thread blocked on a response
    stream every 0.1 s: 10,000 wake-ups a second for 1,000 workers).
    """

    def __init__(
        self, address: str, ids: list[str], heartbeat_s: float, secrets: list[str]
    ) -> None:
        self._address = address
        self._ids = ids
        self._secrets = secrets  # lease secret of each worker (Register's answer)
        self._heartbeat_s = heartbeat_s
        self.sent = 0
        self.failed = 0
        self._loop = asyncio.new_event_loop()
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        self._started.set()
        start, n, period = self._loop.time() + 0.1, len(self._ids), self._heartbeat_s
        await asyncio.gather(*(self._worker(i, start + i / n * period) for i in range(n)))

    async def _worker(self, i: int, first_beat: float) -> None:
        options = [*GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]  # its own connection
        async with grpc.aio.insecure_channel(self._address, options=options) as channel:
            call = coordinator_pb2_grpc.CoordinatorStub(channel).HeartbeatStream()
            schedule = ReplySchedule(
                reply_interval_s(self._heartbeat_s),
                max(self._heartbeat_s * 2, 1.0),  # the worker daemon's heartbeat timeout
            )
            replies = asyncio.ensure_future(self._read(call, schedule))
            beat = 0
            assert self._stopping is not None
            while not self._stopping.is_set():
                delay = first_beat + beat * self._heartbeat_s - self._loop.time()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), delay)
                    continue
                await self._beat(call, schedule, replies, i, beat)
                beat += 1
            await call.done_writing()
            replies.cancel()

    async def _beat(
        self,
        call: grpc.aio.StreamStreamCall,
        schedule: ReplySchedule,
        replies: asyncio.Future[None],
        i: int,
        beat: int,
    ) -> None:
        now = self._loop.time()
        if replies.done() or schedule.overdue(now):
            self.failed += 1  # the stream ended or stopped answering
            return
        request = coordinator_pb2.HeartbeatRequest(
            worker_id=self._ids[i],
            lease_secret=self._secrets[i],
            joined_generation=1,
            status=typical_status(i, beat),
            want_reply=schedule.ask(now),
        )
        try:
            await call.write(request)
            self.sent += 1
        except grpc.RpcError:
            self.failed += 1

    async def _read(self, call: grpc.aio.StreamStreamCall, schedule: ReplySchedule) -> None:
        with contextlib.suppress(grpc.RpcError):
            async for _ in call:
                schedule.replied(self._loop.time())

    def count(self) -> int:
        return self.sent  # an int read from another thread: atomic under the GIL

    def stop(self) -> None:
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=30)


def _measure(n: int, windows: int, window_s: float) -> dict:
    coordinator = _Coordinator(n)
    try:
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            registered = [
                stub.Register(
                    coordinator_pb2.RegisterRequest(
                        address=f"127.0.0.1:{20000 + i}",
                        hostname=f"sim-{i % 64}",
                        pid=100000 + i,
                        devices=["cpu"],
                        backend="gloo",
                        version="0.1.0",
                        store_port=30000 + i,  # simulated: nothing forms, so nothing dials it
                    ),
                    timeout=10,
                )
                for i in range(n)
            ]
            ids = [r.worker_id for r in registered]
            secrets = [r.lease_secret for r in registered]
            beats = _Heartbeats(coordinator.address, ids, HEARTBEAT_S, secrets)
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
    # The target is stated at 1,000 workers, so quick mode measures that too.
    sizes = ctx.sizes([100, 1000], [100, 1000])
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
                # The target is stated at 1,000 workers. Fewer workers beat
                # less often, so each heartbeat also pays waking an idle vCPU (docstring).
                target="<= 1.0" if n >= 1000 else "",
                note=f"CPU per heartbeat {per_beat.text()}; failed heartbeats {m['failed']}; "
                "bound: grpcio's thread wake-ups per stream message (see the row's docstring)",
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
