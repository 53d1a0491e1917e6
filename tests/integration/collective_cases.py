"""What the collective tests share: the dtypes and (dtype, ReduceOp) cases they
are parametrized over, their pytest ids, and small input helpers.

Used by tests/integration/test_collectives_*.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import REDUCE_OPS, make_input, op_valid

__all__ = [
    "DTYPES",
    "INVALID_CASES",
    "REDUCE_CASES",
    "TIMEOUT_S",
    "case_id",
    "chunks",
    "dtype_id",
    "exact",
    "inputs",
    "parametrize_dtype",
    "parametrize_out",
    "parametrize_reduce",
]

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool)
REDUCE_CASES = [(d, op) for d in DTYPES for op in REDUCE_OPS if op_valid(op, d)]
INVALID_CASES = [(d, op) for d in DTYPES for op in REDUCE_OPS if not op_valid(op, d)]
TIMEOUT_S = 30.0


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def case_id(value: object) -> str:
    """pytest ids for (dtype, op) cases: it passes each value separately."""
    return dtype_id(value) if isinstance(value, torch.dtype) else str(value)


def exact(dtype: torch.dtype, op: str) -> bool:
    """Integer/bool results and float min/max are exact; float arithmetic is not."""
    return not dtype.is_floating_point or op in ("min", "max")


def inputs(cluster, dtype, shape, gen) -> list[torch.Tensor]:
    return [make_input(dtype, shape, gen) for _ in range(cluster.world_size)]


def chunks(t: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    assert t.shape[0] % parts == 0
    return torch.chunk(t, parts, dim=0)


parametrize_reduce = pytest.mark.parametrize(("dtype", "op"), REDUCE_CASES, ids=case_id)
parametrize_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
parametrize_out = pytest.mark.parametrize("use_out", [False, True], ids=["in-place", "out"])
