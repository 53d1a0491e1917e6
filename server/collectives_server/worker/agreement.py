"""Small control collectives that keep every rank's view of an op identical.

``exchange`` all-gathers each rank's operand description (and, for small
operands, the operand's bytes: see ``runtime``); ``agree`` all-gathers each
rank's local outcome (a status code and a short message) so that a failure on
one rank is reported, with its reason, on all.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist

from collectives.errors import Reason
from collectives.wire.codec import tensor_memoryview
from collectives_server.worker.validation import INFO_BYTES, INFO_LEN, OperandInfo, decode_info

__all__ = [
    "exchange",
    "exchange_fused",
    "Exchanged",
    "exchange_infos",
    "agree",
    "agree_with",
    "RankOutcome",
    "all_gather_rows",
    "exchange_rows",
]

_STATUS_BYTES = 512
_CODES = {code.value[0]: code for code in grpc.StatusCode}
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


def all_gather_rows(
    pg: dist.ProcessGroup, row: torch.Tensor, size: int, before=None
) -> torch.Tensor:
    """``torch.stack`` of every rank's ``row`` (a contiguous 1-D tensor), in rank order.

    ``before`` (something with ``wait()``, e.g. the leader's pending announcement)
    is waited on after this all-gather was issued and before it is waited on."""
    out = torch.empty((size, row.numel()), dtype=row.dtype)
    work = pg._allgather_base(out.view(-1), row)
    if before is not None:
        before.wait()
    work.wait()
    return out


@dataclass(frozen=True)
class Exchanged:
    """What one exchange gave every rank: each rank's operand info and its row."""

    infos: list[OperandInfo]
    rows: torch.Tensor  # uint8 [size, INFO_BYTES + capacity]

    def payload(self, rank: int, info: OperandInfo) -> torch.Tensor:
        """``rank``'s inline operand (its bytes must have fit), as ``info`` describes it."""
        assert info.dtype is not None
        raw = self.rows[rank, INFO_BYTES : INFO_BYTES + info.nbytes]
        return raw.view(info.dtype).reshape(info.shape)


def exchange(
    pg: dist.ProcessGroup,
    size: int,
    values: list[int],
    operand: torch.Tensor | None = None,
    capacity: int = 0,
    before=None,
) -> Exchanged:
    """All-gathers every rank's info ``values`` followed by ``capacity`` bytes in which
    ``operand`` travels when it fits (otherwise only its info). ``before``: see
    :func:`all_gather_rows`."""
    row = torch.empty(INFO_BYTES + capacity, dtype=torch.uint8)
    _fill_row(tensor_memoryview(row), row, values, operand, capacity)
    rows = all_gather_rows(pg, row, size, before)
    raw = tensor_memoryview(rows)
    stride = row.numel()
    infos = [decode_info(list(_INFO.unpack_from(raw, r * stride))) for r in range(size)]
    return Exchanged(infos, rows)


def _fill_row(
    view: memoryview,
    row: torch.Tensor,
    values: list[int],
    operand: torch.Tensor | None,
    capacity: int,
) -> None:
    """Packs one op's info ``values`` and, when it fits ``capacity``, ``operand``'s bytes
    into ``row`` (a uint8 tensor of INFO_BYTES + capacity bytes; ``view`` is its memory)."""
    _INFO.pack_into(view, 0, *values)
    if capacity:
        n = 0
        if operand is not None:
            n = operand.numel() * operand.element_size()
            if n <= capacity:
                flat = operand.reshape(-1) if operand.device.type == "cpu" else operand.cpu()
                row[INFO_BYTES : INFO_BYTES + n] = flat.reshape(-1).view(torch.uint8)
            else:
                n = 0
        view[INFO_BYTES + n :] = bytes(capacity - n)  # no stray memory on the wire


def exchange_fused(
    pg: dist.ProcessGroup,
    size: int,
    parts: list[tuple[list[int], torch.Tensor | None, int]],
    before=None,
) -> list[Exchanged]:
    """:func:`exchange` of several ops in one all-gather: ``parts`` holds each op's
    (info values, operand, inline capacity), every rank listing the same ops with the
    same capacities; returns each op's :class:`Exchanged`, as if exchanged alone."""
    widths = [INFO_BYTES + capacity for _, _, capacity in parts]
    row = torch.empty(sum(widths), dtype=torch.uint8)
    offsets = []
    start = 0
    for (values, operand, capacity), width in zip(parts, widths, strict=True):
        piece = row[start : start + width]
        _fill_row(tensor_memoryview(piece), piece, values, operand, capacity)
        offsets.append(start)
        start += width
    rows = all_gather_rows(pg, row, size, before)
    raw = tensor_memoryview(rows)
    stride = row.numel()
    out = []
    for offset, width in zip(offsets, widths, strict=True):
        infos = [
            decode_info(list(_INFO.unpack_from(raw, r * stride + offset))) for r in range(size)
        ]
        out.append(Exchanged(infos, rows[:, offset : offset + width]))
    return out


def exchange_infos(pg: dist.ProcessGroup, info: torch.Tensor, size: int) -> list[OperandInfo]:
    """All-gathers each rank's encoded operand info (``validation.encode_info``)."""
    return exchange(pg, size, [int(v) for v in info.tolist()]).infos


def agree(
    pg: dist.ProcessGroup,
    size: int,
    code: grpc.StatusCode,
    message: str = "",
    reason: str | None = None,
) -> list[RankOutcome]:
    """Returns the outcomes of the ranks that failed (empty: all succeeded)."""
    return agree_with(pg, size, code, message, reason=reason)[0]


def agree_with(
    pg: dist.ProcessGroup,
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
    mine = torch.zeros(row_bytes, dtype=torch.uint8)
    encoded = message.encode("utf-8", "replace")[: _STATUS_BYTES - _HEAD]
    view = tensor_memoryview(mine)
    view[0] = code.value[0]
    view[1] = _REASONS.index(Reason(reason)) + 1 if reason in _REASONS else 0
    view[2] = len(encoded) & 0xFF
    view[3] = len(encoded) >> 8
    view[_HEAD : _HEAD + len(encoded)] = encoded
    extras_format = struct.Struct(f"<{len(values)}d")
    extras_format.pack_into(view, _STATUS_BYTES, *values)
    out = all_gather_rows(pg, mine, size)
    raw = tensor_memoryview(out)
    failures = []
    extras = []
    for rank in range(size):
        base = rank * row_bytes
        status = _CODES.get(raw[base], grpc.StatusCode.UNKNOWN)
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
    pg: dist.ProcessGroup, size: int, rows: torch.Tensor, before=None
) -> list[list[OperandInfo]]:
    """All-gathers every rank's ``rows`` (an int64 [n, INFO_LEN] matrix of info values,
    the same n on every rank) in one round; returns ``infos[rank][row]``. For ops on
    several operands (coalesced ops): one info per operand per rank. ``before``: see
    :func:`all_gather_rows`."""
    n = rows.shape[0]
    gathered = all_gather_rows(pg, rows.contiguous().view(-1), size, before)
    values = gathered.view(size, n, INFO_LEN).tolist()
    return [[decode_info(v) for v in by_rank] for by_rank in values]
