"""Many clients at once: the leader sequences every collective, so 8 clients
issuing 200 mixed collectives between them never deadlock the process group,
and every result is what torch computes locally."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import torch
from helpers import REDUCE_OPS, assert_tensor, get_each, make_input, op_valid, reduce_oracle

import collectives

log = logging.getLogger(__name__)

CLIENTS = 8
TOTAL_OPS = 200
DEADLINE_S = 120.0
KINDS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "gather",
    "reduce_scatter",
    "all_to_all",
    "scatter",
    "barrier",
)


def _one_op(cluster, kind: str, name: str, gen: torch.Generator) -> None:
    """Runs one collective of ``kind`` on fresh inputs and checks every rank."""
    n = cluster.world_size
    dtype = (torch.int64, torch.float32)[int(torch.randint(0, 2, (), generator=gen))]
    ops = [op for op in REDUCE_OPS if op_valid(op, dtype)]
    op = ops[int(torch.randint(0, len(ops), (), generator=gen))]
    exact = not dtype.is_floating_point or op in ("min", "max")
    root = int(torch.randint(0, n, (), generator=gen))
    inputs = [make_input(dtype, (2 * n, 3), gen) for _ in range(n)]

    if kind == "barrier":
        assert cluster.barrier(timeout=60) is None
        return
    if kind == "scatter":
        t = make_input(dtype, (2 * n + 1, 2), gen)
        cluster.scatter(name, t, timeout=60)
        for rank, (got, want) in enumerate(
            zip(get_each(cluster, name), torch.tensor_split(t, n), strict=True)
        ):
            assert_tensor(got, want.contiguous(), what=f"{name} scatter rank {rank}")
        cluster.delete(name)
        return

    for rank, t in enumerate(inputs):
        cluster.put(name, t, rank=rank, timeout=60)
    what = f"{name} {kind}"
    if kind == "all_reduce":
        cluster.all_reduce(name, op=op, timeout=60)
        expected = reduce_oracle(op, inputs)
        for rank, got in enumerate(get_each(cluster, name)):
            assert_tensor(got, expected, exact=exact, what=f"{what} {op} rank {rank}")
    elif kind == "broadcast":
        cluster.broadcast(name, src=root, timeout=60)
        for rank, got in enumerate(get_each(cluster, name)):
            assert_tensor(got, inputs[root], what=f"{what} src={root} rank {rank}")
    elif kind == "reduce":
        result = cluster.reduce(name, dst=root, op=op, timeout=60)
        assert_tensor(result, reduce_oracle(op, inputs), exact=exact, what=f"{what} {op}")
        for rank, got in enumerate(get_each(cluster, name)):
            if rank != root:
                assert_tensor(got, inputs[rank], what=f"{what} rank {rank} unchanged")
    elif kind == "all_gather":
        parts = cluster.all_gather(name, timeout=60)
        for rank, part in enumerate(parts):
            assert_tensor(part, inputs[rank], what=f"{what} part {rank}")
        assert_tensor(cluster.get(name, rank=root), torch.stack(inputs), what=what)
    elif kind == "gather":
        parts = cluster.gather(name, dst=root, timeout=60)
        for rank, part in enumerate(parts):
            assert_tensor(part, inputs[rank], what=f"{what} part {rank}")
        assert_tensor(cluster.get(name, rank=root), torch.stack(inputs), what=f"{what} dst")
    elif kind == "reduce_scatter":
        cluster.reduce_scatter(name, op=op, timeout=60)
        chunks = torch.chunk(reduce_oracle(op, inputs), n)
        for rank, got in enumerate(get_each(cluster, name)):
            assert_tensor(got, chunks[rank], exact=exact, what=f"{what} {op} rank {rank}")
    elif kind == "all_to_all":
        cluster.all_to_all(name, timeout=60)
        for j, got in enumerate(get_each(cluster, name)):
            expected = torch.cat([torch.chunk(inputs[i], n)[j] for i in range(n)])
            assert_tensor(got, expected, what=f"{what} rank {j}")
    cluster.delete(name)


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S + 60)
def test_eight_clients_two_hundred_mixed_collectives(cluster3_address, cluster3, seed):
    run = uuid.uuid4().hex[:8]
    per_client = [TOTAL_OPS // CLIENTS + (i < TOTAL_OPS % CLIENTS) for i in range(CLIENTS)]
    done = [0] * CLIENTS
    errors: list[tuple[int, BaseException]] = []
    start_line = threading.Barrier(CLIENTS)

    def client(idx: int) -> None:
        gen = torch.Generator().manual_seed(seed + idx)
        try:
            with collectives.connect(cluster3_address, timeout=60) as cluster:
                start_line.wait(timeout=60)  # every client connected: start together
                for i in range(per_client[idx]):
                    kind = KINDS[(idx + i) % len(KINDS)]
                    _one_op(cluster, kind, f"cc-{run}/c{idx}/op{i}", gen)
                    done[idx] += 1
        except BaseException as exc:
            errors.append((idx, exc))
            start_line.abort()

    threads = [
        threading.Thread(target=client, args=(i,), name=f"client-{i}", daemon=True)
        for i in range(CLIENTS)
    ]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, DEADLINE_S - (time.monotonic() - start)))
    elapsed = time.monotonic() - start

    if errors:
        idx, exc = errors[0]
        raise AssertionError(
            f"{len(errors)} of {CLIENTS} clients failed; client {idx}: {exc!r}"
        ) from exc
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, (
        f"deadlock or stall: {stuck} still running after {DEADLINE_S:.0f} s; "
        f"ops done per client: {done}"
    )
    assert sum(done) == TOTAL_OPS, f"ops done per client: {done}"
    log.info(f"{TOTAL_OPS} collectives from {CLIENTS} clients in {elapsed:.1f} s")
