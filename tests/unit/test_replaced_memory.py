"""Memory of replaced values, reused by the next put or op result of its size
(``worker/replaced_memory.py``).

Kept only when nothing else can still see it (another reference, a view, a
detached alias keeps its bytes); given back after ``idle_s``; bounded in count
and bytes; safe to use from many RPC threads at once.
"""

from __future__ import annotations

import threading

import torch

from collectives.v1 import tensor_pb2
from collectives.wire import codec
from collectives_server.worker.data.replaced_memory import ReplacedMemory, pool_bytes
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.kernels.collective_ops import copy_into, private_copy

MiB = 1 << 20
CPU = torch.device("cpu")


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
    pool = ReplacedMemory()
    old = _received(2 * MiB, gen)
    address = old.data_ptr()
    assert pool.offer(old)
    del old
    assert pool.take(1 * MiB) is None  # another size: not this memory
    buffer = pool.take(2 * MiB)
    assert buffer is not None and buffer.dtype == torch.uint8 and buffer.numel() == 2 * MiB
    assert buffer.data_ptr() == address and pool.puts_reused == 1 and len(pool) == 0
    assert pool.take(2 * MiB) is None  # taken once


def test_memory_anyone_can_still_see_is_not_kept(gen) -> None:
    pool = ReplacedMemory()
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
    pool = ReplacedMemory(max_buffers=2, max_bytes=5 * MiB, idle_s=5.0, clock=clock)
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
    pool = ReplacedMemory(max_buffers=8, max_bytes=64 * MiB)
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
    assert pool.puts_reused == 8  # counted under the lock, from every thread


def _big(value: float = 1.0) -> torch.Tensor:
    return torch.full((MiB // 2,), value)  # 2 MiB of float32


def _replace(store: TensorStore, replaced: ReplacedMemory, value: float) -> bool:
    """What the executor does at a commit: replace, offer the old value, drop it."""
    old = store.replace("y", _big(value))
    return old is not None and replaced.offer(old)


def test_an_exclusive_replaced_value_is_reused_for_the_next_result() -> None:
    store, replaced = TensorStore(CPU), ReplacedMemory()
    store.put("y", _big(1.0))
    assert _replace(store, replaced, 2.0)
    assert len(replaced) == 1
    x = torch.arange(MiB // 2, dtype=torch.float32)
    out = private_copy(x, replaced.empty)
    assert torch.equal(out, x) and len(replaced) == 0
    assert out._base is None and out.is_contiguous()


def test_a_value_still_seen_elsewhere_is_never_reused() -> None:
    store, replaced = TensorStore(CPU), ReplacedMemory()
    for hold in ("same", "view", "detach", "storage-tensor"):
        store.put("y", _big(5.0))
        current = store.get("y")
        if hold == "same":
            holder = current
        elif hold == "view":
            holder = current[10:]
        elif hold == "detach":
            holder = current.detach()
        else:
            holder = torch.empty(0).set_(current.untyped_storage(), 0, (4,))
        del current
        assert not _replace(store, replaced, 6.0), hold
        assert len(replaced) == 0
        # The holder still sees the old bytes after the next results are made.
        for _ in range(2):
            private_copy(_big(9.0), replaced.empty)
        assert float(holder.reshape(-1)[0]) == 5.0, hold
        del holder


def test_limits() -> None:
    replaced = ReplacedMemory(max_buffers=2)
    for value in range(3):
        t = _big(float(value))
        assert replaced.offer(t)  # our one reference, t, is dropped next
        del t
    assert len(replaced) == 2
    small = torch.ones(16)
    assert not replaced.offer(small)  # small: the heap is cheap already
    odd = replaced.empty((3,), torch.float32, CPU)  # no kept buffer of that size
    assert odd.shape == (3,) and len(replaced) == 2


def test_a_reused_buffer_takes_any_dtype_and_shape_of_the_same_size() -> None:
    replaced = ReplacedMemory()
    t = _big()
    assert replaced.offer(t)
    del t
    out = replaced.empty((MiB // 8, 2), torch.float64, CPU)
    assert out.shape == (MiB // 8, 2) and out.dtype == torch.float64 and len(replaced) == 0
    src = torch.randn(MiB // 8, 2, dtype=torch.float64)
    copy_into(out, src)
    assert torch.equal(out, src)


def test_a_replaced_put_becomes_a_result_and_a_replaced_result_a_put(gen) -> None:
    """One pool serves both: the leader of a replicated put replaces an upload (a
    put) and its next value is the next upload; a follower replaces a result."""
    pool = ReplacedMemory()
    put = _received(2 * MiB, gen)
    address = put.data_ptr()
    assert pool.offer(put)
    del put
    result = pool.empty((MiB // 4,), torch.float64, CPU)  # 2 MiB: the put's memory
    assert result.data_ptr() == address and pool.results_reused == 1
    source = torch.randn(MiB // 4, dtype=torch.float64, generator=gen)
    copy_into(result, source)
    assert torch.equal(result, source)
    assert pool.offer(result)
    del result
    buffer = pool.take(2 * MiB)
    assert buffer is not None and buffer.data_ptr() == address and pool.puts_reused == 1


def test_small_results_never_look_in_the_pool(gen) -> None:
    pool = ReplacedMemory()
    assert pool.offer(_received(1 * MiB, gen))
    small = pool.empty((16,), torch.float32, CPU)
    assert small.numel() == 16 and len(pool) == 1 and pool.results_reused == 0


def test_the_pool_stays_within_a_quarter_of_a_store_limit() -> None:
    assert pool_bytes(None) == pool_bytes(0) == 512 * MiB
    assert pool_bytes(64 * MiB) == 16 * MiB
    assert pool_bytes(64 << 30) == 512 * MiB
