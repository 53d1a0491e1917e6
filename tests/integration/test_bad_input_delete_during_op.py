"""Bad input that races an op: deleting an all_reduce's operand while it runs.

Over raw gRPC (``raw_grpc``) to a real local cluster of 2 workers, like the
bad-input matrix in test_bad_input.py: afterwards each worker process must still
be alive and a valid put/get round trip and an all_reduce must still succeed.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from raw_grpc import NOT_FOUND, PRECONDITION, TIMEOUT_S, Env
from raw_grpc import assert_healthy as _assert_healthy
from raw_grpc import opts as _opts

from collectives.v1 import worker_pb2


def test_delete_during_an_op_completes_or_fails_cleanly(env: Env) -> None:
    """DeleteTensor of an all_reduce's operand while the op runs: the op works
    on a snapshot (stored tensors are never mutated in place), so it either
    succeeds with the sum of the values it started from or fails cleanly."""
    parts = [torch.randn(8 << 20) for _ in range(env.world_size)]  # 32 MiB per rank
    name, out = env.name("big"), env.name("bigout")
    env.put_all(name, parts)
    future = env.leader.AllReduce.future(
        worker_pb2.AllReduceRequest(options=_opts(), name=name, out=out), timeout=TIMEOUT_S
    )
    deleted = []
    for rank in range(env.world_size):
        response = env.stubs[rank].DeleteTensor(
            worker_pb2.DeleteTensorRequest(name=name, missing_ok=True), timeout=10
        )
        deleted.append(response.deleted)
    try:
        future.result()
    except grpc.RpcError as err:  # clean failure: the operand vanished before the op saw it
        assert err.code() in (NOT_FOUND, PRECONDITION), (err.code(), err.details())
        assert name in err.details()
    else:
        expected = torch.stack(parts).sum(0)
        for rank in range(env.world_size):
            torch.testing.assert_close(env.get_raw(out, rank), expected)
    assert all(deleted)
    for rank in range(env.world_size):
        with pytest.raises(grpc.RpcError) as info:
            env.get_raw(name, rank)
        assert info.value.code() == NOT_FOUND
        env.stubs[rank].DeleteTensor(
            worker_pb2.DeleteTensorRequest(name=out, missing_ok=True), timeout=10
        )
    _assert_healthy(env)
