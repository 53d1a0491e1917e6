"""A streamed get that fails part-way gives its partial tensor back at once.

The SDK raises a failed get's error inside its ``except`` block: the error's
context keeps the receiving frame, and that frame held the buffer being
filled. A caller retrying a large get with a short deadline then held every
partial tensor until a full garbage collection. The cluster runs with
``--no-bulk`` so the get streams over gRPC.

What the test counts is the partial tensors themselves: the bytes of every
live tensor of 1 MiB or more (found among the objects the garbage collector
tracks) before and after the failed gets, which a kept partial tensor raises
by its whole size. The resident size is only a coarse second check: read
after ``malloc_trim``, it still carries a cancelled stream's in-flight chunks
and the heaps' fragments in a long-lived process such as the full suite's,
with no tensor kept, so it is bounded by one whole tensor.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings

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
    tensors_before = _large_tensor_bytes()
    settled = _held_bytes()
    peak = settled
    for _ in range(12):
        try:
            client.get("fg/big", rank=0, timeout=0.05)
        except collectives.DeadlineExceeded:
            ran_out += 1
        peak = max(peak, _held_bytes())
    kept = _large_tensor_bytes() - tensors_before
    log.info(f"{ran_out} gets ran out of time; RSS peak {(peak - settled) / MiB:.0f} MiB above")
    assert ran_out >= 6, f"only {ran_out} of 12 gets ran out of time: nothing was tested"
    assert kept <= 0, f"{kept / MiB:.0f} MiB of tensors outlived {ran_out} failed gets"
    assert peak - settled < 256 * MiB, (
        f"the client grew {(peak - settled) / MiB:.0f} MiB over {ran_out} failed gets"
    )
    client.delete("fg/big", rank=0)


def _large_tensor_bytes() -> int:
    """The bytes of the storages behind every live tensor of 1 MiB or more."""
    storages = {}
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for tensor in tensors:
        try:
            if tensor.device.type != "cpu" or tensor.is_sparse or tensor.nbytes < MiB:
                continue
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without plain storage
            continue
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _held_bytes() -> int:
    """This process's resident size once glibc gave its free heap pages back."""
    trim()
    return rss_bytes(os.getpid())
