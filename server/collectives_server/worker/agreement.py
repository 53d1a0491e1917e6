"""Small control collectives that keep every rank's view of an op identical.

``exchange_infos`` all-gathers each rank's operand description;
``agree`` all-gathers each rank's local outcome (a status code and a short
message) so that a failure on one rank is reported, with its reason, on all.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist

from collectives.codec import tensor_memoryview
from collectives_server.worker.validation import INFO_LEN, OperandInfo, decode_info

__all__ = ["exchange_infos", "agree", "RankOutcome"]

_STATUS_BYTES = 512
_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    code: grpc.StatusCode
    message: str


def exchange_infos(pg: dist.ProcessGroup, info: torch.Tensor, size: int) -> list[OperandInfo]:
    out = torch.empty((size, INFO_LEN), dtype=torch.int64)
    pg.allgather([[out[i] for i in range(size)]], [info]).wait()
    return [decode_info(out[i]) for i in range(size)]


def agree(
    pg: dist.ProcessGroup, size: int, code: grpc.StatusCode, message: str = ""
) -> list[RankOutcome]:
    """Returns the outcomes of the ranks that failed (empty: all succeeded)."""
    mine = torch.zeros(_STATUS_BYTES, dtype=torch.uint8)
    encoded = message.encode("utf-8", "replace")[: _STATUS_BYTES - 3]
    mine[0] = code.value[0]
    mine[1] = len(encoded) & 0xFF
    mine[2] = len(encoded) >> 8
    if encoded:
        mine[3 : 3 + len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    out = torch.empty((size, _STATUS_BYTES), dtype=torch.uint8)
    pg.allgather([[out[i] for i in range(size)]], [mine]).wait()
    failures = []
    for rank in range(size):
        raw = tensor_memoryview(out[rank].contiguous()).tobytes()
        status = _CODES.get(raw[0], grpc.StatusCode.UNKNOWN)
        if status != grpc.StatusCode.OK:
            length = raw[1] | (raw[2] << 8)
            text = raw[3 : 3 + length].decode("utf-8", "replace")
            failures.append(RankOutcome(rank, status, text))
    return failures
