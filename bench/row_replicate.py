"""Row 1b: ``cluster.put(name, t)`` on every rank of 256 MiB at world 3, and the client's egress.

A float32 tensor of 256 MiB (quick: 16 MiB at world 2) is put with
``rank=None`` on a ``shared_cluster(world)``; each repetition fills it with fresh
random values (not timed), then times the put: the upload once to the leader
(its bulk port) and the replicate op, in which the workers broadcast the bytes
among themselves (one gloo broadcast) and every rank commits.

The anchor, measured in the same run (as row 10's for publish): one
``cluster.put`` of the same tensor to rank 0 of the same cluster, plus one direct
gloo broadcast of those bytes among ``world`` fresh processes
(bench/direct_gloo.py). Its p50 / p99 / worst are the sums of the two parts'
(the parts are in ``extra``). The issue's target: <= 1.3x the anchor at world 3.

Client egress: the TCP payload bytes this process's sockets had acknowledged
during each timed put (bench/egress.py), over the tensor's bytes; the issue
asks for 1x (each byte sent once, to the leader only; parallel puts to every
rank sent world x).
"""

from __future__ import annotations

import torch

import collectives

from . import egress
from .core import BenchContext, MiB, Row, shared_cluster, timed
from .direct_gloo import run_direct
from .sent_once import sent_once_rows

__all__ = ["run", "FULL_BYTES", "QUICK_BYTES"]

NAME = "replicate"
GROUP = "1b replicated put"
PUT_NAME = "bench/replicate/x"
ANCHOR_NAME = "bench/replicate/anchor"
FULL_BYTES = 256 * MiB
QUICK_BYTES = 16 * MiB
TARGET_WORLD = 3
TARGET = "<= 1.3"  # the issue: put(rank=None) of 256 MiB at world 3 <= 1.3x (put + broadcast)
EGRESS_TARGET = "<= 1.01"  # the issue: client egress = 1x the bytes (framing and RPCs: < 1 %)


def _service(world: int, nbytes: int, repeats: int) -> dict:
    """Replicated-put and put-to-rank-0 seconds, egress bytes and closed-socket counts on
    a world-``world`` cluster; its tensors are gone from it afterwards."""
    t = torch.empty(nbytes // 4, dtype=torch.float32)
    log = egress.EgressLog()
    out: dict = {"replicate": [], "put": [], "egress": [], "closed": 0}

    def refill() -> None:  # fresh values every time: nothing can be skipped as unchanged
        t.uniform_(-1.0, 1.0)
        log.start()

    with collectives.connect(shared_cluster(world), timeout=300.0) as cluster:
        try:
            out["replicate"] = timed(
                repeats, 1, refill, lambda: cluster.put(PUT_NAME, t), log.record
            )
            for rank in range(world):
                if not torch.equal(cluster.get(PUT_NAME, rank=rank), t):
                    raise AssertionError(f"rank {rank} does not hold the tensor put last")
            cluster.delete(PUT_NAME)
            out["put"] = timed(
                repeats, 1, lambda: t.uniform_(), lambda: cluster.put(ANCHOR_NAME, t, rank=0)
            )
        finally:  # the cluster is shared with other rows
            cluster.delete(PUT_NAME, missing_ok=True)
            cluster.delete(ANCHOR_NAME, missing_ok=True)
    out["egress"], out["closed"] = log.sent, log.closed
    return out


def _rows(world: int, nbytes: int, repeats: int, quick: bool) -> list[Row]:
    service = _service(world, nbytes, repeats)
    bcast = run_direct(["broadcast"], world, [nbytes], repeats)[("broadcast", nbytes)]
    put, replicated = service["put"], service["replicate"]
    label = f"{nbytes / MiB:.0f} MiB"
    extra = {"replicate_s": replicated}
    return sent_once_rows(
        group=GROUP,
        what=f"put {label} on every rank (rank=None), world {world}",
        egress_what=f"client egress per put of {label} on every rank, world {world}",
        bytes_name="the tensor's bytes",
        service_s=replicated,
        put=put,
        bcast=bcast,
        world=world,
        nbytes=nbytes,
        target=TARGET if world == TARGET_WORLD and not quick else "",
        egress_target=EGRESS_TARGET,
        egress=service["egress"],
        closed=service["closed"],
        extra=extra,
    )


def run(ctx: BenchContext) -> list[Row]:
    if ctx.quick:
        return _rows(2, QUICK_BYTES, 3, True)
    return _rows(TARGET_WORLD, FULL_BYTES, ctx.repeats, False)
