"""The ``replicate`` handler (``put`` on every rank, each byte sent once) on N threads
over the fake process group (``handler_world``).

The leader holds the upload; afterwards every rank holds its bytes under the
target, the leader the very upload tensor (adopted, not copied), and the upload
name is gone. A missing upload or a rank over its quota fails every rank before
any data moves, with every old value left in place and the upload removed. The
calls show the path: the operand exchange, one broadcast, the outcome agreement.
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
import torch
from handler_world import EXCHANGE, Cluster
from helpers import make_input

from collectives.errors import CollectiveError, Reason
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import OpKind
from collectives_server.worker.engine.op_context import OpResult

UPLOAD = "__publish/0123abcd/put"
CASES = [
    (torch.float32, (3, 1000)),
    (torch.bfloat16, (7,)),
    (torch.complex64, (4, 5)),
    (torch.bool, (2, 3, 4)),
    (torch.int64, ()),
    (torch.uint8, (0, 3)),
]


def _replicate(cl: Cluster, out: str = "w", root: int = 0) -> list:
    args = worker_pb2.TensorOpArgs(name=UPLOAD, out=out, root=root)
    return cl.run(worker_pb2.OpDescriptor(kind=OpKind.REPLICATE, replicate=args))


def _same_bits(a: torch.Tensor | None, b: torch.Tensor, what: str) -> None:
    assert a is not None, f"{what}: nothing stored"
    assert (a.dtype, a.shape) == (b.dtype, b.shape), what
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=lambda c: str(c))
def test_every_rank_stores_the_leaders_upload(size: int, dtype, shape) -> None:
    cl = Cluster(size)
    gen = torch.Generator().manual_seed(size * 31 + len(shape))
    old = {r: make_input(torch.float64, (5,), gen) for r in range(1, size)}  # replaced
    cl.put("w", old)
    upload = make_input(dtype, shape, gen)
    expected = upload.clone()
    cl.put(UPLOAD, {0: upload})
    results = _replicate(cl)
    nonempty = upload.numel() > 0
    for r, res in enumerate(results):
        assert isinstance(res, OpResult), f"rank {r}: {res!r}"
        assert (res.result_name, res.result_ranks) == ("w", list(range(size)))
        assert (res.dtype, res.shape) == (dtype, tuple(shape))
        _same_bits(cl.ctxs[r].store.peek("w"), expected, f"rank {r}")
        assert cl.ctxs[r].store.peek(UPLOAD) is None
        assert cl.ctxs[r].store.fenced() == []
        moved = Counter({"broadcast": 1} if nonempty else {})
        assert cl.calls[r] == Counter({EXCHANGE: 2}) + moved, f"rank {r}: {cl.calls[r]}"
    assert cl.ctxs[0].store.peek("w") is upload, "the leader copied its upload"
    held = expected.numel() * expected.element_size()
    assert [ctx.store.stats() for ctx in cl.ctxs] == [(1, held)] * size


def test_a_missing_upload_fails_every_rank_before_data_moves() -> None:
    cl = Cluster(3)
    old = {r: torch.full((4,), float(r)) for r in range(3)}
    cl.put("w", old)
    results = _replicate(cl)
    for r, res in enumerate(results):
        assert isinstance(res, CollectiveError), f"rank {r}: {res!r}"
        assert res.code == grpc.StatusCode.NOT_FOUND
        assert "gone from the leader" in res.message and "put again" in res.message
        assert torch.equal(cl.ctxs[r].store.peek("w"), old[r])
        assert cl.calls[r] == Counter({EXCHANGE: 1}), f"rank {r}: {cl.calls[r]}"


def test_a_rank_over_its_quota_fails_every_rank_and_keeps_every_old_value() -> None:
    nbytes = 4000 * 4
    cl = Cluster(3, limits={2: nbytes + 100})
    old = {r: torch.full((10,), float(r)) for r in range(3)}
    cl.put("w", old)
    cl.put("other", {2: torch.zeros(50)})  # 200 bytes beside w on rank 2
    cl.put(UPLOAD, {0: torch.randn(4000)})
    results = _replicate(cl)
    for r, res in enumerate(results):
        assert isinstance(res, CollectiveError), f"rank {r}: {res!r}"
        assert res.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert res.reason == Reason.QUOTA and res.ranks == (2,)
        assert "failed on rank(s) 2" in res.message and "'w'" in res.message
        assert torch.equal(cl.ctxs[r].store.peek("w"), old[r]), f"rank {r}'s old value"
        assert cl.calls[r] == Counter({EXCHANGE: 1}), f"rank {r}: {cl.calls[r]}"
    assert cl.ctxs[0].store.peek(UPLOAD) is None, "the failed op left its upload behind"


def test_the_leaders_quota_counts_its_upload_once() -> None:
    """The upload becomes the leader's copy: a limit that holds the tensor once (but
    not twice) is enough on the leader."""
    upload = torch.randn(4000)
    nbytes = upload.numel() * upload.element_size()
    cl = Cluster(2, limits={0: nbytes + nbytes // 2})
    cl.put(UPLOAD, {0: upload})
    results = _replicate(cl)
    assert all(isinstance(res, OpResult) for res in results), results
    assert cl.ctxs[0].store.stats() == (1, nbytes)
    assert torch.equal(cl.ctxs[1].store.peek("w"), upload)
