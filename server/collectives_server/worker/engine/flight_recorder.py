"""The flight recorder: a bounded ring of every op this worker ran, with its phases.

Every rank records every op the leader announced to it (ops, publishes,
model ops and forwards alike): the op's descriptor, the group's ranks, the
client that issued it (the leader knows it) and a monotonic stamp for each
phase it reached:

* ``admitted``: the leader admitted it into its queue (leader only)
* ``announced``: the leader sent it to the group, or a follower received it
* ``started``: this rank's handler began: operands are agreed and the data
  collective runs from here
* ``finished``: this rank has its outcome (committed, or failed)

Recording is cheap: the slots are preallocated, a slot is reused in place,
the stamps are ``time.monotonic()`` floats and the descriptor is kept by
reference; nothing is formatted until the ring is read (:meth:`snapshot`).

Each record is bounded in bytes, whatever the op named: a descriptor over
:data:`RECORD_DESCRIPTOR_BYTES` (a coalesced op of a thousand long names) is
kept as a summary with its first :data:`RECORD_NAMES` names, and a message as
its first :data:`RECORD_MESSAGE_CHARS` characters; the record says how much it
left out. The ring's bytes are thus bounded by its capacity.
Only the generation thread (or the submitter running a claimed op, never at
the same time) writes; a reader copies the slots it reads, so a read racing a
write sees one op's stamps a moment old, never another op's.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from collectives.v1 import worker_pb2
from collectives.wire.op_phases import PHASES
from collectives.wire.op_specs import kind_name

__all__ = [
    "PHASES", "RECORD_DESCRIPTOR_BYTES", "RECORD_MESSAGE_CHARS", "RECORD_NAMES",
    "FlightRecorder", "FlightSlot", "RecordedOp", "op_names",
]  # fmt: skip

DEFAULT_OPS = 2000
# What one record keeps of an op: its descriptor by reference up to this size
# (else a summary), this many of its names, this much of its failure message.
RECORD_DESCRIPTOR_BYTES = 2048
RECORD_NAMES = 16
RECORD_MESSAGE_CHARS = 1024


@dataclass(eq=False, slots=True)
class FlightSlot:
    """One op in the ring; written in place (monotonic seconds, 0.0: not reached)."""

    desc: worker_pb2.OpDescriptor | None = None
    rank: int = -1  # this worker's rank in the op's generation
    ranks: list[int] | None = None
    client: str = ""
    admitted: float = 0.0
    announced: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    code: int = -1  # the outcome's gRPC status code value; -1 while in flight
    message: str = ""
    result: object = None  # the committed result (its dtype and shape: the op's bytes)
    # A call that is not sequenced (a forward): no descriptor, these say what it was.
    kind: str = ""
    names: tuple[str, ...] = ()
    generation: int = 0
    call_id: str = ""
    # The recorder's sequence number of the op in this slot now.
    seq: int = -1
    # What the record left out of the op's names and message (see RECORD_*).
    names_omitted: int = 0
    message_omitted: int = 0

    def finish(self, at: float, code: int, message: str = "", result: object = None) -> None:
        if len(message) > RECORD_MESSAGE_CHARS:
            self.message_omitted = len(message) - RECORD_MESSAGE_CHARS
            message = message[:RECORD_MESSAGE_CHARS]
        self.code, self.message, self.result, self.finished = code, message, result, at

    def start_if_held(self, seq: int, at: float) -> None:
        """Stamps the start of the call taken as ``seq`` (see :meth:`finish_if_held`)."""
        if self.seq == seq:
            self.started = at

    def finish_if_held(self, seq: int, at: float, code: int, message: str = "") -> None:
        """Finishes the call taken as sequence number ``seq``, unless the ring has
        since given its slot to a newer op (a call that outlived a whole ring)."""
        if self.seq == seq:
            self.finish(at, code, message)


@dataclass(frozen=True)
class RecordedOp:
    """One op as read from the ring: wall-clock seconds (0.0: phase not reached)."""

    op_id: int
    generation: int
    rank: int
    kind: str
    names: tuple[str, ...]
    ranks: tuple[int, ...]
    client: str
    phases: dict[str, float] = field(default_factory=dict)
    code: int = -1
    message: str = ""
    nbytes: int = 0  # of this rank's result (0: unknown, or none)
    dtype: str = ""
    # A forward's call id (the same on every rank of one data-parallel call); op_id 0.
    call_id: str = ""
    # The recorder's sequence number of this op (the order ops were recorded in).
    seq: int = 0
    # Names and message characters the record left out (see RECORD_*).
    names_omitted: int = 0
    message_omitted: int = 0

    @property
    def in_flight(self) -> bool:
        return self.code < 0


# A wall-clock read bracketed by two monotonic reads further apart than this was
# preempted in between; the offset is read again (a bounded number of times).
_TIGHT_BRACKET_S = 50e-6
_OFFSET_TRIES = 8


def _wall_clock_offset() -> float:
    """``time.time() - time.monotonic()``, from the tightest of a few bracketed reads.

    Ranks compare their stamps across processes (which rank started an op last):
    a thread preempted between the two clock reads would shift every stamp of its
    rank by the time it lost, on a loaded machine milliseconds, enough to name the
    wrong straggler."""
    best_width, best_offset = math.inf, 0.0
    for _ in range(_OFFSET_TRIES):
        before = time.monotonic()
        wall = time.time()
        after = time.monotonic()
        width = after - before
        if width < best_width:
            best_width, best_offset = width, wall - (before + after) / 2
        if width <= _TIGHT_BRACKET_S:
            break
    return best_offset


def op_names(desc: worker_pb2.OpDescriptor) -> tuple[str, ...]:
    """The tensor (or model) names an op works on, as its descriptor names them."""
    which = desc.WhichOneof("args")
    if which is None:
        return ()
    args = getattr(desc, which)
    names: list[str] = []
    for attr in ("name", "model", "out", "prefix"):
        value = getattr(args, attr, "")
        if isinstance(value, str) and value:
            names.append(value)
    names.extend(getattr(args, "names", ()))
    return tuple(dict.fromkeys(names))


class FlightRecorder:
    """The ring of the last ``capacity`` ops (0: recording off, every call a no-op)."""

    def __init__(self, capacity: int = DEFAULT_OPS) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._slots = [FlightSlot() for _ in range(capacity)]
        self._next = 0  # ops recorded so far; the next slot is _next % capacity
        # Taking a slot: the generation thread and the RPC threads running forwards.
        self._taking = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def open(
        self,
        desc: worker_pb2.OpDescriptor,
        rank: int,
        ranks: list[int] | None,
        announced: float,
        admitted: float = 0.0,
        client: str = "",
    ) -> FlightSlot | None:
        """Takes the next slot for ``desc`` run as ``rank`` of its generation in a group of
        ``ranks`` (announced at ``announced``); None when recording is off."""
        if not self.capacity:
            return None
        slot = self._take()
        kept, omitted = _bounded(desc)
        slot.desc, slot.rank, slot.ranks, slot.client = kept, rank, ranks, client
        slot.admitted, slot.announced = admitted, announced
        slot.kind, slot.names, slot.generation, slot.call_id = "", (), 0, ""
        slot.names_omitted = omitted
        return slot

    def open_call(
        self,
        kind: str,
        names: tuple[str, ...],
        call_id: str,
        rank: int,
        generation: int,
        admitted: float,
        client: str = "",
    ) -> FlightSlot | None:
        """Takes the next slot for a call this worker runs on its own (a forward): no
        op id, no announcement; ``admitted`` is when its RPC arrived. None when off."""
        if not self.capacity:
            return None
        slot = self._take()
        slot.desc, slot.rank, slot.ranks, slot.client = None, rank, [rank], client
        slot.admitted, slot.announced = admitted, 0.0
        slot.names_omitted = max(0, len(names) - RECORD_NAMES)
        names = names[:RECORD_NAMES]
        slot.kind, slot.names, slot.generation, slot.call_id = kind, names, generation, call_id
        return slot

    def _take(self) -> FlightSlot:
        """The next slot, cleared of its outcome (the caller fills in the rest)."""
        with self._taking:
            slot = self._slots[self._next % self.capacity]
            slot.seq = -1  # a reader copying the old op sees it changed (see _read)
            slot.admitted = slot.announced = slot.started = slot.finished = 0.0
            slot.code, slot.message, slot.result = -1, "", None
            slot.message_omitted = 0
            slot.desc = None  # not readable until the caller fills it in
            slot.kind = ""
            slot.seq = self._next
            self._next += 1
        return slot

    def held_before(self, seq: int) -> int:
        """How many ops the ring still holds that were recorded before ``seq``."""
        return max(0, min(seq, self._next) - max(0, self._next - self.capacity))

    @property
    def recorded(self) -> int:
        """Ops recorded since the start (the sequence number of the next one)."""
        return self._next

    def snapshot(self, last: int = 0, before: int = 0) -> list[RecordedOp]:
        """The last ``last`` ops (0: all held) recorded before sequence number
        ``before`` (0: up to the newest), oldest first, in wall-clock seconds."""
        if not self.capacity:
            return []
        end = self._next if before <= 0 else min(before, self._next)
        start = max(0, self._next - self.capacity)
        if last > 0:
            start = max(start, end - last)
        return self._read(range(start, end)) if end > start else []

    def finished_since(self, seq: int) -> tuple[list[RecordedOp], int]:
        """The ops recorded from sequence number ``seq`` on that finished, up to the first
        still in flight, and the sequence number to ask from next time: for a reader that
        folds every finished op once (the phase histograms). Ops the ring overwrote
        before they were read are skipped."""
        if not self.capacity:
            return [], seq
        end = self._next
        seq = max(seq, end - self.capacity)
        done = seq
        while done < end and self._slots[done % self.capacity].code >= 0:
            done += 1
        return self._read(range(seq, done)), done

    def _read(self, seqs: range) -> list[RecordedOp]:
        offset = _wall_clock_offset()
        ops: list[RecordedOp] = []
        for i in seqs:
            slot = self._slots[i % self.capacity]
            # Sequence-checked: a writer taking the slot for a newer op marks it first
            # (_take), so a copy whose slot held op i before and after is op i's.
            if slot.seq != i:
                continue
            desc, ranks, kind = slot.desc, slot.ranks, slot.kind
            stamps = [getattr(slot, phase) for phase in PHASES]
            code, message, result = slot.code, slot.message, slot.result
            names, generation, call_id = slot.names, slot.generation, slot.call_id
            client, rank = slot.client, slot.rank
            omitted = (slot.names_omitted, slot.message_omitted)
            if slot.seq != i or (desc is None and not kind):
                continue
            nbytes, dtype = _result_bytes(result)
            ops.append(
                RecordedOp(
                    op_id=desc.op_id if desc is not None else 0,
                    generation=desc.generation if desc is not None else generation,
                    rank=rank,
                    kind=kind_name(desc.kind) if desc is not None else kind,
                    names=op_names(desc) if desc is not None else names,
                    ranks=tuple(ranks or ()),
                    client=client,
                    phases={p: s + offset for p, s in zip(PHASES, stamps, strict=True) if s},
                    code=code,
                    message=message,
                    nbytes=nbytes,
                    dtype=dtype,
                    call_id=call_id,
                    seq=i,
                    names_omitted=omitted[0],
                    message_omitted=omitted[1],
                )
            )
        return ops


def _bounded(desc: worker_pb2.OpDescriptor) -> tuple[worker_pb2.OpDescriptor, int]:
    """``desc`` itself when it is small, else a summary of it a record can keep (its
    ids, kind and first :data:`RECORD_NAMES` names), and how many names it left out."""
    if desc.ByteSize() <= RECORD_DESCRIPTOR_BYTES:
        return desc, 0
    kept = worker_pb2.OpDescriptor(
        op_id=desc.op_id, generation=desc.generation, group_id=desc.group_id,
        timeout_s=desc.timeout_s, kind=desc.kind,
    )  # fmt: skip
    which = desc.WhichOneof("args")
    if which is None:
        return kept, 0
    args, kept_args = getattr(desc, which), getattr(kept, which)
    kept_args.SetInParent()
    for attr in ("name", "model", "out", "prefix"):
        value = getattr(args, attr, None)
        if isinstance(value, str) and value:
            setattr(kept_args, attr, value)
    names = getattr(args, "names", None)
    if names is None:
        return kept, 0
    kept_args.names.extend(names[:RECORD_NAMES])
    return kept, max(0, len(names) - RECORD_NAMES)


def _result_bytes(result: object) -> tuple[int, str]:
    """A result's byte count and dtype name, from its ``dtype`` and ``shape`` if it has them."""
    dtype, shape = getattr(result, "dtype", None), getattr(result, "shape", None)
    itemsize = getattr(dtype, "itemsize", 0)
    if not itemsize or shape is None:
        return 0, ""
    return math.prod(shape) * itemsize, str(dtype).removeprefix("torch.")
