"""On a real local cluster, failed calls carry structured fields in their status
details and the SDK exposes them as attributes (sync and ``async_op`` alike),
beside the messages ``test_errors.py`` checks.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from helpers import make_input

import collectives

TIMEOUT_S = 30.0


def test_get_of_a_missing_tensor_names_it_and_the_call(cluster2, uname):
    name = uname("missing")
    with pytest.raises(collectives.NotFound) as info:
        cluster2.get(name, rank=0, timeout=TIMEOUT_S)
    err = info.value
    assert err.code == grpc.StatusCode.NOT_FOUND and name in err.message
    assert str(err).startswith("NOT_FOUND: ")
    assert err.tensor == name and err.kind == "get"
    assert err.op_id is None and err.ranks == ()


def test_a_failed_async_collective_names_its_tensor_and_generation(cluster2, uname):
    name = uname("missing")
    work = cluster2.all_reduce(name, timeout=TIMEOUT_S, async_op=True)
    with pytest.raises(collectives.NotFound) as info:
        work.wait(TIMEOUT_S)
    err = info.value
    assert name in err.message and err.tensor == name
    assert err.generation is not None and err.generation == work.generation


def test_an_operand_on_some_ranks_only_names_the_tensor(cluster2, gen, uname):
    name = uname("partial")
    cluster2.put(name, make_input(torch.float32, (4,), gen), rank=0)
    with pytest.raises(collectives.FailedPrecondition) as info:
        cluster2.all_reduce(name, timeout=TIMEOUT_S)
    err = info.value
    assert name in err.message and err.tensor == name
    assert err.generation == cluster2.generation


def test_a_failed_collective_carries_the_engines_op_id_kind_ranks_and_reason(cluster2, gen, uname):
    """The op engine fills the structured fields: which op, which kind, which ranks."""
    name = uname("partial")
    cluster2.put(name, make_input(torch.float32, (4,), gen), rank=0)
    with pytest.raises(collectives.FailedPrecondition) as info:
        cluster2.all_reduce(name, timeout=TIMEOUT_S)
    err = info.value
    assert err.kind == "all_reduce" and err.reason == "OPERAND_MISSING"
    assert err.ranks == (1,), err  # the rank that lacks the operand
    assert isinstance(err.op_id, int) and err.op_id > 0
    assert f"op {err.op_id} (all_reduce, generation {err.generation})" in err.message
    cluster2.put(name, make_input(torch.float32, (5,), gen), rank=1)
    with pytest.raises(collectives.FailedPrecondition) as info:
        cluster2.all_reduce(name, timeout=TIMEOUT_S)
    assert info.value.reason == "OPERAND_MISMATCH" and info.value.op_id > err.op_id


def test_an_operand_missing_everywhere_names_every_rank_and_never_ran(cluster2, uname):
    with pytest.raises(collectives.NotFound) as info:
        cluster2.all_reduce(uname("nowhere"), timeout=TIMEOUT_S)
    err = info.value
    assert "(ranks 0, 1)" in err.message
    assert err.ranks == (0, 1) and err.executed is False, repr(err)


def test_refusals_before_the_op_started_say_executed_false(cluster2, gen, uname):
    """Shape and dtype mismatches and missing operands never ran: safe to retry."""
    name = uname("mismatch")
    cluster2.put(name, make_input(torch.float32, (4,), gen), rank=0)
    cluster2.put(name, make_input(torch.float32, (5,), gen), rank=1)
    with pytest.raises(collectives.CollectiveError) as shape:
        cluster2.all_reduce(name, timeout=TIMEOUT_S)
    cluster2.put(name, make_input(torch.float64, (4,), gen), rank=1)
    with pytest.raises(collectives.CollectiveError) as dtype:
        cluster2.all_reduce(name, timeout=TIMEOUT_S)
    cluster2.delete(name, rank=1)
    with pytest.raises(collectives.CollectiveError) as missing:
        cluster2.all_reduce(name, timeout=TIMEOUT_S)
    for err in (shape.value, dtype.value, missing.value):
        assert err.executed is False and err.ranks, repr(err)
    assert missing.value.ranks == (1,)
