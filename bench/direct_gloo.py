"""The anchor of rows 3 and 6: torch.distributed gloo directly, in fresh processes.

``run_direct(op, world, nbytes, repeats)`` spawns ``world`` processes of::

    python -m bench.direct_gloo --rank R --world W --port P --op all_reduce --bytes N --repeats K

each of which builds ``ProcessGroupGloo(PrefixStore("g", TCPStore(...)), rank, world,
timeout)`` (the workers' configuration, see docs/engine.md, one process group
per generation), runs the op a few times as warmup, then times ``K`` ops one by one.
Rank 0 prints ``{"seconds": [...]}`` (one figure per op) on stdout.

Besides the service's ops (``OPS``), ``all_reduce_copy`` copies the operand into a
pre-faulted buffer (one memmove, as the workers do) and all-reduces the copy: the
fastest a gloo all_reduce can be when the operand must stay as it was (an
``out=`` name, or an op that may still fail), measured beside plain gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

__all__ = [
    "OPS",
    "ANCHOR_OPS",
    "free_port",
    "spawn_ranks",
    "run_direct",
    "gloo_group",
    "time_op",
]

OPS = ("all_reduce", "broadcast", "all_gather")
ANCHOR_OPS = (*OPS, "all_reduce_copy")
_ROOT = Path(__file__).resolve().parent.parent
_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(module: str, world: int, args: list[str], timeout: float = _TIMEOUT_S) -> dict:
    """Runs ``python -m module --rank r --world w --port p *args`` for every rank;
    returns the JSON rank 0 printed (its last stdout line)."""
    port = free_port()
    common = ["--world", str(world), "--port", str(port), *args]
    with contextlib.ExitStack() as stack:
        errs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, "--rank", str(r), *common],
                cwd=_ROOT,  # the workers' environment: same threads, nothing pinned
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            for r, err in enumerate(errs)
        ]
        outputs = []
        try:
            for r, p in enumerate(procs):
                out, _ = p.communicate(timeout=timeout)
                outputs.append(out)
                if p.returncode != 0:
                    errs[r].seek(0)
                    tail = errs[r].read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"{module} rank {r} exited with {p.returncode}: {tail}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    lines = [line for line in outputs[0].splitlines() if line.strip()]
    return json.loads(lines[-1])


def run_direct(
    ops: list[str], world: int, sizes: list[int], repeats: int | list[int], warmup: int = 2
) -> dict[tuple[str, int], list[float]]:
    """Seconds per op with direct gloo for every (op, nbytes) pair (float32 tensors),
    one figure per op; one set of ``world`` processes measures them all. ``repeats``:
    one count for every size, or one per size (e.g. many small ops, few large ones)."""
    counts = repeats if isinstance(repeats, list) else [repeats]
    if len(counts) not in (1, len(sizes)):
        raise ValueError(f"{len(counts)} repeat counts for {len(sizes)} sizes")
    args = ["--op", ",".join(ops), "--bytes", ",".join(map(str, sizes))]
    args += ["--repeats", ",".join(map(str, counts)), "--warmup", str(warmup)]
    seconds = spawn_ranks("bench.direct_gloo", world, args)["seconds"]
    return {(op, n): seconds[f"{op}:{n}"] for op in ops for n in sizes}


def gloo_group(rank: int, world: int, port: int = 0, timeout_s: float = _TIMEOUT_S, store=None):
    """The workers' group construction: a PrefixStore over a TCPStore, rank 0 its master
    (``store``: an existing TCPStore instead of a new one on ``port``)."""
    import torch.distributed as dist

    if store is None:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=rank == 0,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
    prefixed = dist.PrefixStore("g", store)
    return store, dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=timeout_s))


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--op", required=True, help="comma-separated, of " + ", ".join(ANCHOR_OPS))
    parser.add_argument("--bytes", required=True, help="comma-separated sizes")
    parser.add_argument("--repeats", default="5", help="one count, or one per size")
    parser.add_argument("--warmup", type=int, default=2)
    a = parser.parse_args()

    import torch

    store, pg = gloo_group(a.rank, a.world, a.port)
    results: dict[str, list[float]] = {}
    sizes = [int(b) for b in a.bytes.split(",")]
    counts = [int(r) for r in a.repeats.split(",")]
    counts = counts * len(sizes) if len(counts) == 1 else counts
    for nbytes, repeats in zip(sizes, counts, strict=True):
        t = torch.full((max(1, nbytes // 4),), float(a.rank + 1), dtype=torch.float32)
        parts = [torch.empty_like(t) for _ in range(a.world)]
        for op in a.op.split(","):
            results[f"{op}:{nbytes}"] = time_op(pg, op, t, parts, a.warmup, repeats)
    pg.barrier().wait()
    if a.rank == 0:
        print(json.dumps({"seconds": results}), flush=True)
    del pg, store
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown around gloo threads


def time_op(pg, op: str, t, parts, warmup: int, repeats: int) -> list[float]:
    import torch.distributed as dist

    if op not in ANCHOR_OPS:
        raise SystemExit(f"unknown op {op!r}")
    copy = None
    if op == "all_reduce_copy":
        copy = t.clone()  # written once: its pages are faulted in before the timing

    def once() -> None:
        if op in ("all_reduce", "all_reduce_copy"):
            if copy is not None:
                ctypes.memmove(copy.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            pg.allreduce([t if copy is None else copy], opts).wait()
        elif op == "broadcast":
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([t], opts).wait()
        else:
            pg.allgather([parts], [t]).wait()

    for _ in range(warmup):
        once()
    seconds = []
    for _ in range(repeats):
        pg.barrier().wait()  # every rank starts together, as in the service's pipeline
        started = time.perf_counter()
        once()
        seconds.append(time.perf_counter() - started)
    return seconds


if __name__ == "__main__":
    _main()
