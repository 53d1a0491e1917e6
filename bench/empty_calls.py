"""Concurrent empty gRPC calls: what the gRPC legs alone allow, with no op behind them.

:func:`empty_call_rounds` runs ``clients`` threads of this process, each with its
own channel, issuing ``grpc.health.v1`` Check calls back to back to one server,
in the same rounds (barrier-started, ``plan.duration_s`` each) as the SDK clients
of :func:`bench.concurrent_clients.run_clients`. Its aggregate calls/s is a
ceiling for any service op that is one unary call to that server from clients
like these: the op can only add work to the call.
"""

from __future__ import annotations

import threading
import time

from .concurrent_clients import ClientRound, Plan, round_rate, timed_round

__all__ = ["empty_call_rates"]

_TIMEOUT_S = 30.0


def _caller(
    address: str,
    plan: Plan,
    start: threading.Barrier,
    done: threading.Barrier,
    out: list[ClientRound],
    errors: list[BaseException],
) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest()
            for _ in range(plan.warmup):
                stub.Check(request, timeout=_TIMEOUT_S)
            for _ in range(plan.rounds):
                start.wait()
                out.append(timed_round(plan, lambda: stub.Check(request, timeout=_TIMEOUT_S)))
                done.wait()
    except threading.BrokenBarrierError:
        pass  # another caller failed; its error is reported
    except BaseException as exc:
        errors.append(exc)
        start.abort()
        done.abort()


def empty_call_rates(address: str, clients: int, plan: Plan) -> list[float]:
    """Aggregate health Check calls/s of ``clients`` concurrent callers, one per round."""
    start = threading.Barrier(clients + 1, timeout=_TIMEOUT_S)
    done = threading.Barrier(clients + 1, timeout=_TIMEOUT_S)
    outs: list[list[ClientRound]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(
            target=_caller,
            args=(address, plan, start, done, outs[i], errors),
            name=f"bench-empty-{i}",
            daemon=True,
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    try:
        for _ in range(plan.rounds):
            start.wait()
            done.wait()
    except threading.BrokenBarrierError:
        pass
    deadline = time.monotonic() + _TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads) or any(len(o) != plan.rounds for o in outs):
        raise RuntimeError(f"{clients} empty callers did not finish their rounds in time")
    return [round_rate([outs[c][r] for c in range(clients)]) for r in range(plan.rounds)]
