"""A first run: start a local cluster of 2 workers, run collectives on real
tensors, check every result against torch computed locally, stop the cluster.

    python examples/demo.py            (or: make demo)

Exits 0 when every result matches, 1 with a message when one does not, and
always stops the cluster it started.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import torch

import collectives

WORKERS = 2
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


class Mismatch(Exception):
    """A result differs from what torch computes locally."""


def start_cluster() -> tuple[subprocess.Popen[str], str]:
    """Starts ``collectives-server local`` and returns it with the coordinator address."""
    argv = [sys.executable, "-m", "collectives_server", "local", "--workers", str(WORKERS)]
    proc = subprocess.Popen(
        [*argv, "--port", "0", "--log-level", "WARNING"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    address = lines[0].strip() if lines else ""
    if not address:
        stop_cluster(proc)
        raise SystemExit(f"the local cluster printed no address within {START_TIMEOUT_S:.0f} s")
    # Keep draining its stdout so the launcher never blocks on a full pipe.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, address


def stop_cluster(proc: subprocess.Popen[str]) -> int:
    """SIGTERM, bounded wait, SIGKILL as a last resort; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(f"cluster stopped (launcher exit code {proc.returncode})")
    return proc.returncode


def check(what: str, got: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> None:
    ok = (
        torch.equal(got, expected)
        if exact
        else got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    )
    if not ok:
        raise Mismatch(f"{what}: got {got.tolist()}, torch computes {expected.tolist()}")
    print(f"  ok   {what}: {fmt(got)}")


def fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:7.3f}" for v in t.flatten().tolist()) + "]"


def run(cluster: collectives.Cluster) -> None:
    n = cluster.world_size
    print(f"connected: generation {cluster.generation}, world size {n}")
    for w in cluster.workers():
        print(f"  rank {w.rank}  {w.address}  {w.state}  devices={','.join(w.devices)}")
    gen = torch.Generator().manual_seed(int(time.time()))
    inputs = [torch.randn(4, generator=gen) for _ in range(n)]
    for rank, t in enumerate(inputs):
        print(f"put x on rank {rank}: {fmt(t)}")

    def put_inputs(name: str) -> None:
        for rank, t in enumerate(inputs):
            cluster.put(name, t, rank=rank)

    print("broadcast x from rank 1")
    put_inputs("x")
    cluster.broadcast("x", src=1)
    for rank in range(n):
        check(f"rank {rank} holds rank 1's x", cluster.get("x", rank=rank), inputs[1], exact=True)

    print("all_reduce x (sum)")
    put_inputs("x")
    cluster.all_reduce("x", op="sum")
    total = torch.stack(inputs).sum(0)
    for rank in range(n):
        check(f"rank {rank} holds the sum", cluster.get("x", rank=rank), total)

    print("reduce x to rank 0 (max)")
    put_inputs("x")
    reduced = cluster.reduce("x", dst=0, op="max")
    check("reduce returned the max", reduced, torch.stack(inputs).amax(0), exact=True)
    check("rank 1 kept its input", cluster.get("x", rank=1), inputs[1], exact=True)

    print("all_gather x")
    put_inputs("x")
    parts = cluster.all_gather("x", out="x_all")
    for rank, part in enumerate(parts):
        check(f"part {rank} is rank {rank}'s x", part, inputs[rank], exact=True)
    check("rank 1 stored the stack", cluster.get("x_all", rank=1), torch.stack(inputs), exact=True)

    print("gather x to rank 1")
    parts = cluster.gather("x", dst=1, out="x_gathered")
    for rank, part in enumerate(parts):
        check(f"part {rank} is rank {rank}'s x", part, inputs[rank], exact=True)
    check("rank 1 stored the stack", cluster.get("x_gathered", rank=1), torch.stack(inputs), True)

    for name in ("x", "x_all", "x_gathered"):
        cluster.delete(name, missing_ok=True)


def main() -> int:
    print(f"starting a local cluster of {WORKERS} workers ...")
    proc, address = start_cluster()
    print(f"coordinator at {address}")
    try:
        with collectives.connect(address, timeout=60) as cluster:
            run(cluster)
    except Mismatch as exc:
        print(f"MISMATCH: {exc}", file=sys.stderr)
        return 1
    except collectives.CollectiveError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        code = stop_cluster(proc)
    if code != 0:
        print(f"FAILED: the launcher exited with {code} on SIGTERM (expected 0)", file=sys.stderr)
        return 1
    print("every result matches torch computed locally")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
