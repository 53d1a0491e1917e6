"""A streamed get that fails part-way gives its partial tensor back at once.

The SDK raises a failed get's error inside its ``except`` block: the error's
context keeps the receiving frame, and that frame held the buffer being
filled. A caller retrying a large get with a short deadline then held every
partial tensor until a full garbage collection. The cluster runs with
``--no-bulk`` so the get streams over gRPC.

The resident size is read after ``malloc_trim``: glibc keeps the freed 4 MiB
chunks of a stream in its heaps, more of them in a long-lived process such as
the full suite's, and that is not memory the client holds. A partial
tensor still referenced stays resident whatever the trim.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hostile import rss_bytes

import collectives
from collectives_server.worker.data.memory_release import trim

log = logging.getLogger(__name__)

MiB = 1 << 20


@pytest.mark.timeout(180)
def test_gets_that_run_out_of_time_do_not_keep_their_partial_tensors(fresh_cluster, gen) -> None:
    _, client = fresh_cluster(2, "--no-bulk")
    big = torch.randn(64 * MiB, generator=gen)  # 256 MiB: far more than 50 ms of streaming
    client.put("fg/big", big, rank=0)
    del big
    ran_out = 0
    settled = _held_bytes()
    peak = settled
    for _ in range(12):
        try:
            client.get("fg/big", rank=0, timeout=0.05)
        except collectives.DeadlineExceeded:
            ran_out += 1
        peak = max(peak, _held_bytes())
    log.info(f"{ran_out} gets ran out of time; RSS peak {(peak - settled) / MiB:.0f} MiB above")
    assert ran_out >= 6, f"only {ran_out} of 12 gets ran out of time: nothing was tested"
    assert peak - settled < 128 * MiB, (
        f"the client grew {(peak - settled) / MiB:.0f} MiB over {ran_out} failed gets"
    )
    client.delete("fg/big", rank=0)


def _held_bytes() -> int:
    """This process's resident size once glibc gave its free heap pages back."""
    trim()
    return rss_bytes(os.getpid())
