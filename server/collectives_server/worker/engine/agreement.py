"""Small control collectives that keep every rank's view of an op identical.

``exchange`` all-gathers each rank's operand description (and, for small
operands, the operand's bytes: see ``handlers.tensor_ops``); ``agree`` all-gathers each
rank's local outcome (a status code and a short message) so that a failure on
one rank is reported, with its reason, on all.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from collectives.errors import Reason, status_code
from collectives.wire.codec import tensor_memoryview
from collectives_server.worker.engine.control_rounds import rounds_of
from collectives_server.worker.engine.validation import (
    INFO_BYTES,
    INFO_LEN,
    OperandInfo,
    decode_info,
)

__all__ = [
    "exchange",
    "exchange_fused",
    "Exchanged",
    "agree",
    "agree_with",
    "RankOutcome",
    "all_gather_json",
    "all_gather_rows",
    "exchange_rows",
]

_STATUS_BYTES = 512
# A failure's machine-readable reason travels as one byte: 0 none, i + 1 the i-th Reason.
_REASONS = list(Reason)
_HEAD = 4  # code, reason, message length (2 bytes)
_INFO = struct.Struct(f"<{INFO_LEN}q")


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    code: grpc.StatusCode
    message: str
    reason: str | None = None


def all_gather_rows(pg: object, row: torch.Tensor, size: int, before=None) -> torch.Tensor:
    """``torch.stack`` of every rank's ``row`` (a contiguous 1-D CPU tensor), in rank
    order, over ``pg`` (a ``ControlChannel`` or a process group).

    ``before`` (something with ``wait()``, e.g. the leader's pending announcement)
    is waited on after this all-gather was issued and before it is waited on."""
    mine = row.contiguous()  # held here: the view below does not keep it alive
    table = rounds_of(pg).all_gather(tensor_memoryview(mine), before)
    if not len(table):
        return torch.empty((size, row.numel()), dtype=row.dtype, device="cpu")
    return torch.frombuffer(table, dtype=row.dtype).view(size, row.numel())


@dataclass(frozen=True)
class Exchanged:
    """What one exchange gave every rank: each rank's operand info, and the table of
    every rank's row (this op's row starts ``offset`` bytes into each ``stride``)."""

    infos: list[OperandInfo]
    table: memoryview
    stride: int
    offset: int = 0

    def payload(self, rank: int, info: OperandInfo) -> torch.Tensor:
        """``rank``'s inline operand (its bytes must have fit), as ``info`` describes it
        (a view of the table: copy it before keeping it)."""
        assert info.dtype is not None
        if not info.nbytes:
            return torch.empty(info.shape, dtype=info.dtype, device="cpu")
        start = rank * self.stride + self.offset + INFO_BYTES
        count = info.nbytes // info.dtype.itemsize
        return torch.frombuffer(self.table, dtype=info.dtype, count=count, offset=start).view(
            info.shape
        )


def exchange(
    pg: object,
    size: int,
    values: list[int],
    operand: torch.Tensor | None = None,
    capacity: int = 0,
    before=None,
) -> Exchanged:
    """All-gathers every rank's info ``values`` followed by ``capacity`` bytes in which
    ``operand`` travels when it fits (otherwise only its info). ``before``: see
    :func:`all_gather_rows`."""
    row = bytearray(INFO_BYTES + capacity)
    _fill_row(row, 0, values, operand, capacity)
    table = rounds_of(pg).all_gather(row, before)
    stride = len(row)
    infos = [decode_info(list(_INFO.unpack_from(table, r * stride))) for r in range(size)]
    return Exchanged(infos, table, stride)


def _fill_row(
    row: bytearray, at: int, values: list[int], operand: torch.Tensor | None, capacity: int
) -> None:
    """Packs one op's info ``values`` and, when it fits ``capacity``, ``operand``'s bytes
    into ``row`` from byte ``at`` (INFO_BYTES + capacity bytes, zeroed: no stray memory
    goes on the wire)."""
    _INFO.pack_into(row, at, *values)
    if capacity and operand is not None:
        n = operand.numel() * operand.element_size()
        if 0 < n <= capacity:
            start = at + INFO_BYTES
            plain = _plain(operand)  # held here: the view below does not keep it alive
            row[start : start + n] = tensor_memoryview(plain)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor whose memory holds its values."""
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


def exchange_fused(
    pg: object,
    size: int,
    parts: list[tuple[list[int], torch.Tensor | None, int]],
    before=None,
) -> list[Exchanged]:
    """:func:`exchange` of several ops in one all-gather: ``parts`` holds each op's
    (info values, operand, inline capacity), every rank listing the same ops with the
    same capacities; returns each op's :class:`Exchanged`, as if exchanged alone."""
    widths = [INFO_BYTES + capacity for _, _, capacity in parts]
    row = bytearray(sum(widths))
    offsets = []
    start = 0
    for (values, operand, capacity), width in zip(parts, widths, strict=True):
        _fill_row(row, start, values, operand, capacity)
        offsets.append(start)
        start += width
    table = rounds_of(pg).all_gather(row, before)
    stride = len(row)
    out = []
    for offset in offsets:
        infos = [
            decode_info(list(_INFO.unpack_from(table, r * stride + offset))) for r in range(size)
        ]
        out.append(Exchanged(infos, table, stride, offset))
    return out


def agree(
    pg: object,
    size: int,
    code: grpc.StatusCode,
    message: str = "",
    reason: str | None = None,
) -> list[RankOutcome]:
    """Returns the outcomes of the ranks that failed (empty: all succeeded)."""
    return agree_with(pg, size, code, message, reason=reason)[0]


def agree_with(
    pg: object,
    size: int,
    code: grpc.StatusCode,
    message: str = "",
    extra: list[float] | None = None,
    reason: str | None = None,
) -> tuple[list[RankOutcome], list[list[float]]]:
    """:func:`agree`, with ``extra`` float64 values from every rank in the same exchange
    (every rank passes as many); returns (the failed ranks' outcomes, the values by rank)."""
    values = extra or []
    row_bytes = _STATUS_BYTES + 8 * len(values)
    mine = bytearray(row_bytes)
    encoded = message.encode("utf-8", "replace")[: _STATUS_BYTES - _HEAD]
    mine[0] = code.value[0]
    mine[1] = _REASONS.index(Reason(reason)) + 1 if reason in _REASONS else 0
    mine[2] = len(encoded) & 0xFF
    mine[3] = len(encoded) >> 8
    mine[_HEAD : _HEAD + len(encoded)] = encoded
    extras_format = struct.Struct(f"<{len(values)}d")
    extras_format.pack_into(mine, _STATUS_BYTES, *values)
    raw = rounds_of(pg).all_gather(mine)
    failures = []
    extras = []
    for rank in range(size):
        base = rank * row_bytes
        status = status_code(raw[base])
        if status != grpc.StatusCode.OK:
            which = raw[base + 1]
            why = _REASONS[which - 1].value if 0 < which <= len(_REASONS) else None
            length = raw[base + 2] | (raw[base + 3] << 8)
            start = base + _HEAD
            text = bytes(raw[start : start + length]).decode("utf-8", "replace")
            failures.append(RankOutcome(rank, status, text, why))
        extras.append(list(extras_format.unpack_from(raw, base + _STATUS_BYTES)))
    return failures, extras


def exchange_rows(
    pg: object, size: int, rows: torch.Tensor, before=None
) -> list[list[OperandInfo]]:
    """All-gathers every rank's ``rows`` (an int64 [n, INFO_LEN] matrix of info values,
    the same n on every rank) in one round; returns ``infos[rank][row]``. For ops on
    several operands (coalesced ops): one info per operand per rank. ``before``: see
    :func:`all_gather_rows`."""
    n = rows.shape[0]
    gathered = all_gather_rows(pg, rows.contiguous().view(-1), size, before)
    values = gathered.view(size, n, INFO_LEN).tolist()
    return [[decode_info(v) for v in by_rank] for by_rank in values]


def all_gather_json(call: Callable[..., Any], control: object, size: int, value: object) -> list:
    """Every rank's ``value`` (JSON-able), by rank: its length, then its bytes padded to
    the longest, on the control group. ``call`` runs a collective with the op's
    failure handling (``OpContext.call``)."""
    data = json.dumps(value).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device="cpu")
    sizes = call(all_gather_rows, control, length, size)
    row = torch.zeros(int(sizes.max()), dtype=torch.uint8, device="cpu")  # the control group
    if data:
        row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = call(all_gather_rows, control, row, size)
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(size)]
