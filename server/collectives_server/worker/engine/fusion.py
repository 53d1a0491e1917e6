"""Which queued ops the leader announces and exchanges together. Pure logic.

Small ops from concurrent clients each cost a descriptor broadcast and an
operand exchange, i.e. two control rounds whose latency, not their bytes,
bounds how many ops per second a generation runs. When several are queued,
the leader takes a run of them from the head of its FIFO and announces them
in one broadcast; every rank then exchanges all their operand infos (and
inline bytes) in one all-gather, and finishes each op in order on its own
slice of that exchange (Horovod's fusion of ready tensors, for ops rather than
gradients). Each op keeps its own decision, result, error and reply.

An op joins the run only when running it fused is indistinguishable from
running it alone, right after the ops before it:

* a collective on one named tensor of the world group, whose operand the
  leader saw small enough to travel inline (``tensor_ops.inline_capacity``);
* no name it reads or writes is read or written by an op already in the run,
  because every op of a run reads its operand at the one shared exchange,
  before the ops ahead of it commit;
* the run stays within :data:`MAX_OPS` and :data:`MAX_ROW_BYTES` per rank.

The run is a prefix of the queue: an op that cannot join ends it, so ops keep
their admission order.
"""

from __future__ import annotations

from collectives.v1 import worker_pb2
from collectives.wire.op_specs import spec
from collectives_server.worker.engine.validation import INFO_BYTES

__all__ = ["MAX_OPS", "MAX_ROW_BYTES", "Run", "fusable", "names_of"]

MAX_OPS = 64
MAX_ROW_BYTES = 512 * 1024


def fusable(desc: worker_pb2.OpDescriptor, inline: int | None) -> bool:
    """Whether ``desc`` (with the leader's inline capacity) may run inside a fused run."""
    return (
        inline is not None
        and desc.group_id == 0
        and desc.WhichOneof("args") in ("tensor", None)
        and spec(desc.kind).is_collective
    )


def names_of(desc: worker_pb2.OpDescriptor) -> set[str]:
    """The store names ``desc`` reads or writes."""
    return {n for n in (desc.tensor.name, desc.tensor.out) if n}


class Run:
    """The ops taken so far for one fused announcement."""

    def __init__(self) -> None:
        self.items: list[tuple[worker_pb2.OpDescriptor, int | None]] = []
        self._names: set[str] = set()
        self._row_bytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def admits(self, desc: worker_pb2.OpDescriptor, inline: int | None) -> bool:
        """Whether ``desc`` can join (the first op joins whenever it is fusable)."""
        if not fusable(desc, inline) or len(self.items) >= MAX_OPS:
            return False
        assert inline is not None
        if self.items and self._row_bytes + INFO_BYTES + inline > MAX_ROW_BYTES:
            return False
        return not (names_of(desc) & self._names)

    def add(self, desc: worker_pb2.OpDescriptor, inline: int | None) -> None:
        self.items.append((desc, inline))
        self._names |= names_of(desc)
        self._row_bytes += INFO_BYTES + (inline or 0)
