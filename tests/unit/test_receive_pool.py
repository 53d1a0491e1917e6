"""Memory a put replaced, reused by the next put of its size (``worker/receive_pool.py``).

Kept only when nothing else can still see it; given back after ``idle_s``; bounded
in count and bytes; safe to use from many RPC threads at once.
"""

from __future__ import annotations

import threading

import torch

from collectives.v1 import tensor_pb2
from collectives.wire import codec
from collectives_server.worker.receive_pool import ReceivePool

MiB = 1 << 20


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _received(nbytes: int, gen: torch.Generator) -> torch.Tensor:
    """A float32 tensor as a put lands: a tensor of its own on a uint8 buffer."""
    header = tensor_pb2.TensorHeader(
        name="w", dtype=codec.to_wire(torch.float32), shape=[nbytes // 4], nbytes=nbytes
    )
    assembler = codec.TensorAssembler(header)
    payload = torch.randn(nbytes // 4, generator=gen)
    assembler.add(codec.tensor_memoryview(payload))
    t = assembler.finish()
    assert torch.equal(t, payload)
    return t


def test_a_replaced_put_is_the_next_put_of_its_size(gen) -> None:
    pool = ReceivePool()
    old = _received(2 * MiB, gen)
    address = old.data_ptr()
    assert pool.offer(old)
    del old
    assert pool.take(1 * MiB) is None  # another size: not this memory
    buffer = pool.take(2 * MiB)
    assert buffer is not None and buffer.dtype == torch.uint8 and buffer.numel() == 2 * MiB
    assert buffer.data_ptr() == address and pool.reused == 1 and len(pool) == 0
    assert pool.take(2 * MiB) is None  # taken once


def test_memory_anyone_can_still_see_is_not_kept(gen) -> None:
    pool = ReceivePool()
    t = _received(2 * MiB, gen)
    other = t  # a second reference (a GET in flight, a collective reading it)
    assert not pool.offer(t)
    del other
    view = t[: MiB // 4]  # a view on its storage
    assert not pool.offer(t)
    del view
    assert not pool.offer(t[: MiB // 4])  # a view itself
    assert not pool.offer(torch.randn(1000, generator=gen))  # under 1 MiB: the heap's business
    assert not pool.offer(torch.randn(MiB, generator=gen).requires_grad_())
    assert len(pool) == 0
    assert pool.offer(t)  # alone at last


def test_kept_memory_is_bounded_and_given_back_when_idle(gen) -> None:
    clock = _Clock()
    pool = ReceivePool(max_buffers=2, max_bytes=5 * MiB, idle_s=5.0, clock=clock)
    for size in (1, 2, 3):  # the third evicts the oldest (count), then bytes (2 + 3 <= 5)
        assert pool.offer(_received(size * MiB, gen))
        clock.now += 1
    assert len(pool) == 2 and pool.held_bytes == 5 * MiB
    assert pool.offer(_received(4 * MiB, gen))  # 3 + 4 > 5 MiB: only the newest stays
    assert pool.held_bytes == 4 * MiB
    clock.now += 4.5
    assert pool.expire() == 0  # kept 4.5 s ago
    clock.now += 1
    assert pool.expire() == 1 and len(pool) == 0


def test_threads_never_share_a_buffer(gen) -> None:
    pool = ReceivePool(max_buffers=8, max_bytes=64 * MiB)
    for _ in range(8):
        assert pool.offer(_received(1 * MiB, gen))
    taken: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def take() -> None:
        start.wait(10)
        for _ in range(4):
            b = pool.take(1 * MiB)
            if b is not None:
                with lock:
                    taken.append(b.data_ptr())

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(taken) == 8 and len(set(taken)) == 8 and len(pool) == 0
