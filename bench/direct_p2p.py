"""The anchor of the point-to-point row: a direct gloo send/recv pair, in 2 fresh processes.

``python -m bench.direct_p2p --rank R --world 2 --port P --bytes N --repeats K`` builds
the workers' gloo group (``direct_gloo.gloo_group``); rank 0 sends ``N`` bytes to
rank 1, which answers with a 1-byte acknowledgement once they arrived, so rank 0's
time covers the delivery, as the service's ``send`` does (its leader answers after
the dst received and every rank agreed). Rank 0 prints ``{"seconds": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.direct_gloo import gloo_group, spawn_ranks

__all__ = ["run_direct_send"]

_TAG = 11


def run_direct_send(nbytes: int, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds per send of ``nbytes`` (received and acknowledged), one figure per send."""
    args = ["--bytes", str(nbytes), "--repeats", str(repeats), "--warmup", str(warmup)]
    return spawn_ranks("bench.direct_p2p", 2, args)["seconds"]


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    a = parser.parse_args()

    import torch

    store, pg = gloo_group(a.rank, a.world, a.port)
    payload = torch.ones(max(1, a.bytes), dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)

    for _ in range(a.warmup):
        _once(pg, a.rank, payload, ack)
    seconds = []
    for _ in range(a.repeats):
        pg.barrier().wait()  # both ranks start together
        started = time.perf_counter()
        _once(pg, a.rank, payload, ack)
        seconds.append(time.perf_counter() - started)
    pg.barrier().wait()
    if a.rank == 0:
        print(json.dumps({"seconds": seconds}), flush=True)
    del pg, store
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown around gloo threads


def _once(pg, rank: int, payload, ack) -> None:
    """Rank 0 sends the payload and waits for rank 1's acknowledgement of it."""
    if rank == 0:
        pg.send([payload], 1, _TAG).wait()
        pg.recv([ack], 1, _TAG + 1).wait()
    else:
        pg.recv([payload], 0, _TAG).wait()
        pg.send([ack], 0, _TAG + 1).wait()


if __name__ == "__main__":
    _main()
