"""What answers at an address that should have been a coordinator, in words.

A client given a worker's port sees ``UNIMPLEMENTED: Method not found!`` from
the coordinator's first call; this module asks that server what it is (a
worker answers ``GetState``, which names its coordinator) so the SDK and the
CLI can say "this is a worker, its coordinator is at ...".
"""

from __future__ import annotations

import grpc

from collectives.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["not_a_coordinator"]

# Bound on the one GetState asked of whatever answered.
_ASK_TIMEOUT_S = 2.0


def not_a_coordinator(channel: grpc.Channel, address: str, timeout: float) -> str:
    """A sentence naming what serves at ``address`` over ``channel``, which lacks the
    coordinator's service; it asks for at most ``min(timeout, 2 s)``."""
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        state = stub.GetState(worker_pb2.GetStateRequest(), timeout=min(timeout, _ASK_TIMEOUT_S))
    except grpc.RpcError:
        return (
            f"{address} answers gRPC but is not a collectives coordinator (it serves no "
            "collectives.v1.Coordinator); give the address the coordinator prints first"
        )
    where = f"rank {state.rank}" if state.rank >= 0 else "not a member"
    coordinator = (
        f"its coordinator is at {state.coordinator}: connect to that"
        if state.coordinator
        else "connect to its coordinator"
    )
    return (
        f"{address} is a collectives worker ({state.worker_id}, {where}), not a "
        f"coordinator; {coordinator}"
    )
