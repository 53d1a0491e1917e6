"""``cluster.get(name, rank, out=t)``: the bytes land in the caller's tensor.

Over every path a get can take: inline in the reply (small), the bulk port,
the gRPC stream (``--no-bulk``) and shared memory. ``out`` itself comes back,
holding exactly the stored value; an ``out`` that does not fit is refused with
``InvalidArgument`` and left as it was, and the worker serves the next get.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CONNECT_TIMEOUT_S, wait_until

import collectives

MiB = 1 << 20
SIZES = {"inline": 64, "large": 3 * MiB // 8}  # elements of int64: 512 B and 3 MiB


@pytest.fixture(scope="module", params=["bulk", "stream", "shm"])
def client(request, cluster2_address, local_cluster):
    if request.param == "stream":
        address = local_cluster(1, "--no-bulk")
        options = {}
    else:
        address = cluster2_address
        options = {"shared_memory": request.param == "shm"}
    with collectives.connect(address, timeout=CONNECT_TIMEOUT_S, **options) as c:
        wait_until(lambda: c.world_size >= 1, CONNECT_TIMEOUT_S, "a formed cluster")
        yield c


@pytest.mark.parametrize("size", sorted(SIZES))
def test_the_bytes_land_in_out_and_out_comes_back(client, gen, uname, size) -> None:
    name = uname("out")
    stored = torch.randint(-(2**62), 2**62, (SIZES[size],), generator=gen)
    client.put(name, stored, rank=0)
    out = torch.randint(-(2**62), 2**62, (SIZES[size],), generator=gen)
    address = out.data_ptr()
    got = client.get(name, rank=0, out=out)
    assert got is out and out.data_ptr() == address
    assert torch.equal(out, stored)
    # A second get into the same tensor, after the value changed.
    stored2 = torch.randint(-(2**62), 2**62, (SIZES[size],), generator=gen)
    client.put(name, stored2, rank=0)
    assert torch.equal(client.get(name, rank=0, out=out), stored2)
    client.delete(name)


@pytest.mark.parametrize("size", sorted(SIZES))
def test_an_out_that_does_not_fit_is_refused_and_left_as_it_was(client, gen, uname, size) -> None:
    n = SIZES[size]
    name = uname("misfit")
    stored = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    client.put(name, stored, rank=0)
    misfits = {
        "shape": torch.randint(-(2**62), 2**62, (n + 1,), generator=gen),
        "dtype": torch.randn(n, generator=gen, dtype=torch.float64),
        "2-d": torch.randint(-(2**62), 2**62, (2, n // 2), generator=gen),
    }
    for why, out in misfits.items():
        before = out.clone()
        with pytest.raises(collectives.InvalidArgument, match=name) as info:
            client.get(name, rank=0, out=out)
        assert "out is" in info.value.message, why
        assert torch.equal(out, before), f"{why}: out was written"
    # Refused before any call: not contiguous, or requiring grad.
    for out in (
        torch.zeros(2 * n, dtype=torch.int64)[::2],  # strided
        torch.zeros(n, dtype=torch.float64, requires_grad=True),
    ):
        with pytest.raises(collectives.InvalidArgument, match="out must"):
            client.get(name, rank=0, out=out)
    # The worker lost nothing and serves the next get.
    assert torch.equal(client.get(name, rank=0), stored)
    client.delete(name)
