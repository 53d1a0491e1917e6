"""Row 4b: small ops under concurrency, ``cluster.all_reduce`` of 4 bytes at world 2.

Measured on the ``shared_cluster(2)``: 1, 8 and 32 SDK clients (threads of this
process, each with its own ``collectives.connect`` and its own tensor name;
bench/concurrent_clients.py) each issue an in-place ``all_reduce(op="sum")`` of
a 4-byte float32 tensor back to back for a few timed rounds, all clients started
together by a barrier. Every op's result is checked (chained in-place sums of
different random values per rank, one ``get`` per rank per chain); a wrong value
fails the row.

Rows and anchors (both measured in the same run, on the same cluster):
- 8 clients' aggregate ops/s against the single client's ops/s; target >= 4x
  (the service overlaps or fuses independent small ops instead of running them
  one at a time).
- 8 clients' per-op latency p50 against the single client's p50; target <= 2x.
- 32 clients' aggregate ops/s against the single client's ops/s; no target (scaling).
- What bounds the 8 clients: the ops/s this machine's cores could run at the CPU
  per op the 8-client rounds cost (the client process and every cluster process,
  from /proc; bench/cpu.py), against the single client's ops/s. No target: it is
  the highest ratio the first row could reach on this machine, however the
  service overlapped or fused its ops.
- And what bounds any service built on gRPC here: 8 threads of this process
  issuing empty health Check calls to the leader's gRPC server, in the same
  rounds (bench/empty_calls.py), against the single client's ops/s. No target:
  an op that is one such call can only add to it.
"""

from __future__ import annotations

import os

import collectives

from .concurrent_clients import ConcurrentResult, Plan, run_clients
from .core import BenchContext, Row, Stat, cluster_processes, shared_cluster, stat_of
from .empty_calls import empty_call_rates

NAME = "concurrency"
GROUP = "4b concurrency"
WORLD = 2


def plan(ctx: BenchContext) -> Plan:
    """Quick: 2 rounds of 0.5 s; full: 3 rounds of 2 s (per client count)."""
    if ctx.quick:
        return Plan(rounds=2, duration_s=0.5, max_ops=5_000)
    return Plan(rounds=3, duration_s=2.0, max_ops=20_000)


def _note(run: ConcurrentResult, single: ConcurrentResult) -> str:
    return (
        f"{run.summary()}; anchor {single.summary()}; clients are threads of one process "
        "(its CPU use shows the Python client is not the limit)"
    )


def run(ctx: BenchContext) -> list[Row]:
    address = shared_cluster(WORLD)
    p = plan(ctx)
    prefix = "bench/concurrency"
    pids = cluster_processes(address)
    single = run_clients(address, WORLD, 1, p, prefix=f"{prefix}/1", server_pids=pids)
    eight = run_clients(address, WORLD, 8, p, prefix=f"{prefix}/8", server_pids=pids)
    many = run_clients(address, WORLD, 32, p, prefix=f"{prefix}/32", server_pids=pids)
    anchor_rate = single.ops_per_s()
    rows = [
        Row(
            group=GROUP,
            what="all_reduce 4 B world 2: 8 clients aggregate ops/s",
            service=eight.ops_per_s(),
            anchor_name="1 client ops/s (same cluster, same run)",
            anchor=anchor_rate,
            target=">= 4",
            note=_note(eight, single),
            extra={"service": eight.as_extra(), "anchor": single.as_extra()},
        ),
        Row(
            group=GROUP,
            what="all_reduce 4 B world 2: 8 clients per-client p50",
            service=eight.latency(),
            anchor_name="1 client p50",
            anchor=single.latency(),
            target="<= 2",
            note=(
                "p50/p99 over every op of every client; each client's own p50 "
                f"{min(eight.client_p50s) * 1e3:.3g}-{max(eight.client_p50s) * 1e3:.3g} ms"
            ),
            extra={"service": eight.as_extra(), "anchor": single.as_extra()},
        ),
        Row(
            group=GROUP,
            what="all_reduce 4 B world 2: 32 clients aggregate ops/s",
            service=many.ops_per_s(),
            anchor_name="1 client ops/s (same cluster, same run)",
            anchor=anchor_rate,
            note=_note(many, single),
            extra={"service": many.as_extra(), "anchor": single.as_extra()},
        ),
    ]
    if pids:
        rows.append(_ceiling_row(eight, single, anchor_rate))
    rows.append(_empty_call_row(address, p, anchor_rate))
    return rows


def _empty_call_row(address: str, p: Plan, anchor_rate: Stat) -> Row:
    with collectives.connect(address, timeout=60.0) as cluster:
        leader = next(w for w in cluster.workers() if w.rank == 0)
    rates = empty_call_rates(leader.address, 8, p)
    return Row(
        group=GROUP,
        what="8 clients' empty gRPC calls/s to the leader (no op)",
        service=stat_of(rates, "/s"),
        anchor_name="1 client ops/s (same cluster, same run)",
        anchor=anchor_rate,
        note=(
            "8 threads of this process, each with its own channel, call grpc.health.v1 "
            "Check on the leader's server back to back in the same rounds as the clients; "
            "a service op that is one unary call to that server can only add work, so this "
            "ratio is the most the 8-client ratio could reach with gRPC on this machine"
        ),
        extra={"rates": rates, "leader": leader.address},
    )


def _ceiling_row(eight: ConcurrentResult, single: ConcurrentResult, anchor_rate: Stat) -> Row:
    cores = os.cpu_count() or 1
    return Row(
        group=GROUP,
        what="all_reduce 4 B world 2: ops/s the cores allow at 8 clients' CPU per op",
        service=stat_of([eight.cpu_ceiling(cores)], "/s"),
        anchor_name="1 client ops/s (same cluster, same run)",
        anchor=anchor_rate,
        note=(
            f"{cores} cores / {eight.cpu_per_op_s * 1e3:.2f} ms CPU per op over "
            f"{eight.ops} ops ({eight.cpu_breakdown()}); 1 client: "
            f"{single.cpu_per_op_s * 1e3:.2f} ms ({single.cpu_breakdown()}). The ratio is "
            "the most the 8-client ratio could reach on this machine"
        ),
        extra={"cores": cores, "service": eight.as_extra(), "anchor": single.as_extra()},
    )
