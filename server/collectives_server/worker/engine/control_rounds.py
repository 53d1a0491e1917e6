"""The control rounds' interface: what ``descriptor`` and ``agreement`` need from a group.

Every op's control is two kinds of round among all ranks: the leader's
announcement (a message of any length from rank 0 to every rank) and an
all-gather of equal-length byte rows (the operand exchange, the outcome
agreement). :class:`ControlRounds` is that interface, in bytes.

A generation's own rounds go over its ``ControlChannel`` (plain TCP, no
tensors). :func:`rounds_of` gives the same interface over a torch process
group (:class:`ProcessGroupRounds`): gloo, or the tests' in-memory fake. There
an announcement travels in a fixed slot of :data:`SLOT_BYTES` (a length, then
the message's first bytes) and, when longer, a second broadcast of the rest;
and the leader need not wait for its own broadcast before issuing the next
all-gather (``announce`` returns the pending send; pass it as ``before``).
"""

from __future__ import annotations

import struct
from typing import Protocol

import torch
import torch.distributed as dist

from collectives.wire.codec import tensor_memoryview

__all__ = [
    "Buffer",
    "Waitable",
    "ControlRounds",
    "ProcessGroupRounds",
    "rounds_of",
    "SLOT_BYTES",
]

Buffer = bytes | bytearray | memoryview
SLOT_BYTES = 1024
_LENGTH = struct.Struct("<q")


class Waitable(Protocol):
    def wait(self) -> object: ...


class ControlRounds(Protocol):
    def announce(self, message: bytes) -> Waitable | None:
        """Leader (rank 0): sends ``message`` to every rank; a returned handle must be
        waited on (or passed as ``before``) before its delivery is relied on."""

    def receive_announcement(self, max_bytes: int) -> bytes:
        """Any other rank: the leader's next message (longer than ``max_bytes``: an error)."""

    def all_gather(self, row: Buffer, before: Waitable | None = None) -> memoryview:
        """Every rank's ``row`` (equal lengths), in rank order, as one fresh table;
        ``before`` is waited on after this round was issued."""


def rounds_of(pg: object) -> ControlRounds:
    """``pg`` itself when it speaks :class:`ControlRounds` (a ``ControlChannel``), else
    the rounds over ``pg`` as a torch process group."""
    if hasattr(type(pg), "receive_announcement"):
        return pg  # type: ignore[return-value]
    return ProcessGroupRounds(pg)  # type: ignore[arg-type]


class _Pending:
    """The leader's broadcasts of one announcement, and the tensors they send."""

    __slots__ = ("_tensors", "_works")

    def __init__(self, works: list[dist.Work], tensors: list[torch.Tensor]) -> None:
        self._works = works
        self._tensors = tensors  # alive until sent

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        self._tensors = []


class ProcessGroupRounds:
    """:class:`ControlRounds` over a torch process group (root 0, the group's order)."""

    __slots__ = ("_pg",)

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self._pg = pg

    def _broadcast(self, t: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self._pg.broadcast([t], opts)

    def announce(self, message: bytes) -> _Pending:
        head = _LENGTH.pack(len(message)) + message[: SLOT_BYTES - _LENGTH.size]
        slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8, device="cpu")
        tensor_memoryview(slot)[: len(head)] = head
        tensors = [slot]
        rest = message[SLOT_BYTES - _LENGTH.size :]
        if rest:
            tensors.append(torch.frombuffer(bytearray(rest), dtype=torch.uint8))
        return _Pending([self._broadcast(t) for t in tensors], tensors)

    def receive_announcement(self, max_bytes: int) -> bytes:
        slot = torch.empty(SLOT_BYTES, dtype=torch.uint8, device="cpu")
        self._broadcast(slot).wait()
        raw = tensor_memoryview(slot)
        (length,) = _LENGTH.unpack_from(raw)
        if not 0 <= length <= max_bytes:
            raise ValueError(f"malformed announcement ({length} bytes, at most {max_bytes})")
        message = raw[_LENGTH.size : _LENGTH.size + length].tobytes()
        missing = length - len(message)
        if missing > 0:
            rest = torch.empty(missing, dtype=torch.uint8, device="cpu")
            self._broadcast(rest).wait()
            message += tensor_memoryview(rest).tobytes()
        return message

    def all_gather(self, row: Buffer, before: Waitable | None = None) -> memoryview:
        mine = torch.frombuffer(bytearray(row), dtype=torch.uint8) if len(row) else None
        if mine is None:
            mine = torch.empty(0, dtype=torch.uint8, device="cpu")
        out = torch.empty(mine.numel() * self._pg.size(), dtype=torch.uint8, device="cpu")
        work = self._pg._allgather_base(out, mine)
        if before is not None:
            before.wait()
        work.wait()
        return memoryview(bytearray(tensor_memoryview(out)))
