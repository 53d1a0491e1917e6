"""Bad input gets the status code docs/api.md names, quickly, with a message
a person can act on, and the cluster serves the next request correctly.

Codes (docs/api.md, "Errors" and "Conventions shared by every call"):
unknown tensor → NOT_FOUND (names it); operand on some ranks only, or dtype/shape
disagreeing across ranks → FAILED_PRECONDITION (names tensor and ranks); bad
src/dst/rank/name/op, bitwise op on floats, avg on integers → INVALID_ARGUMENT
(``collectives.InvalidArgument``, also a ``ValueError``); nothing listening →
UNAVAILABLE or DEADLINE_EXCEEDED within connect()'s timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
import torch
from helpers import assert_tensor, get_each, make_input, put_each, reduce_oracle
from launcher import free_port

import collectives

# "Within seconds": generous for a loaded 2-core CI machine, far below any timeout.
FAST_S = 5.0
TIMEOUT_S = 30.0


def expect_error(
    call: Callable[[], object],
    code: grpc.StatusCode,
    *,
    within_s: float = FAST_S,
) -> collectives.CollectiveError:
    """Runs ``call``; it must raise a CollectiveError with ``code`` within ``within_s``."""
    start = time.monotonic()
    with pytest.raises(collectives.CollectiveError) as info:
        call()
    elapsed = time.monotonic() - start
    err = info.value
    assert err.code == code, f"expected {code.name}, got {err!r}"
    assert elapsed < within_s, f"{code.name} took {elapsed:.2f} s (limit {within_s} s)"
    assert err.message.strip(), "the error has no message"
    text = str(err)
    assert code.name in text and err.message in text, f"str() must show code and message: {text}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert isinstance(err, collectives.InvalidArgument) and isinstance(err, ValueError)
    return err


def assert_serves(cluster, gen, uname) -> None:
    """The next request after an error succeeds and is correct."""
    name = uname("after-error")
    inputs = [make_input(torch.float32, (4,), gen) for _ in range(cluster.world_size)]
    put_each(cluster, name, inputs)
    cluster.all_reduce(name, op="sum", timeout=TIMEOUT_S)
    expected = reduce_oracle("sum", inputs)
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, expected, exact=False, what=f"all_reduce after an error, rank {rank}")


def _call(cluster, collective: str, name: str):
    """A zero-argument call of ``collective`` on ``name`` with valid other arguments."""
    last = cluster.world_size - 1
    kwargs = {
        "broadcast": {"src": last},
        "reduce": {"dst": last},
        "gather": {"dst": last},
    }.get(collective, {})
    return lambda: getattr(cluster, collective)(name, timeout=TIMEOUT_S, **kwargs)


COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "reduce_scatter",
    "all_to_all",
)
CONTRIBUTING = tuple(c for c in COLLECTIVES if c != "broadcast")


# ------------------------------------------------------------- unknown tensor


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_unknown_tensor_is_not_found(cluster, gen, uname, collective):
    name = uname("unknown")
    err = expect_error(_call(cluster, collective, name), grpc.StatusCode.NOT_FOUND)
    assert name in err.message, f"the message must name the tensor: {err}"
    assert_serves(cluster, gen, uname)


def test_get_unknown_tensor_is_not_found(cluster2, gen, uname):
    name = uname("unknown")
    err = expect_error(lambda: cluster2.get(name, rank=1), grpc.StatusCode.NOT_FOUND)
    assert name in err.message
    assert_serves(cluster2, gen, uname)


# ------------------------------------------- operands that disagree across ranks


@pytest.mark.parametrize("collective", CONTRIBUTING)
def test_operand_on_some_ranks_only_is_failed_precondition(cluster, gen, uname, collective):
    n = cluster.world_size
    name = uname("partial")
    t = make_input(torch.float32, (2 * n,), gen)
    cluster.put(name, t, rank=0)  # missing on ranks 1..n-1

    err = expect_error(_call(cluster, collective, name), grpc.StatusCode.FAILED_PRECONDITION)

    assert name in err.message, f"the message must name the tensor: {err}"
    for rank in range(1, n):
        assert str(rank) in err.message, f"the message must name missing rank {rank}: {err}"
    assert_tensor(cluster.get(name, rank=0), t, what="rank 0 keeps its operand")
    assert_serves(cluster, gen, uname)


def test_broadcast_without_the_tensor_on_src_is_failed_precondition(cluster, gen, uname):
    n = cluster.world_size
    name = uname("nosrc")
    t = make_input(torch.int64, (3,), gen)
    cluster.put(name, t, rank=0)  # present on 0, absent on src = n - 1

    err = expect_error(
        lambda: cluster.broadcast(name, src=n - 1, timeout=TIMEOUT_S),
        grpc.StatusCode.FAILED_PRECONDITION,
    )

    assert name in err.message and str(n - 1) in err.message, err
    assert_tensor(cluster.get(name, rank=0), t)
    assert_serves(cluster, gen, uname)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "gather"])
@pytest.mark.parametrize("mismatch", ["dtype", "shape"])
def test_operands_disagreeing_is_failed_precondition(cluster, gen, uname, collective, mismatch):
    n = cluster.world_size
    name = uname(mismatch)
    inputs = [make_input(torch.float32, (2 * n, 2), gen) for _ in range(n)]
    odd = n - 1
    if mismatch == "dtype":
        inputs[odd] = inputs[odd].to(torch.float64)
    else:
        inputs[odd] = make_input(torch.float32, (2 * n, 3), gen)
    put_each(cluster, name, inputs)

    err = expect_error(_call(cluster, collective, name), grpc.StatusCode.FAILED_PRECONDITION)

    assert name in err.message, f"the message must name the tensor: {err}"
    for rank, got in enumerate(get_each(cluster, name)):
        assert_tensor(got, inputs[rank], what=f"rank {rank} must be unchanged")
    assert_serves(cluster, gen, uname)


# ---------------------------------------------------------- argument errors


def test_src_dst_rank_out_of_range_is_invalid_argument(cluster, gen, uname):
    n = cluster.world_size
    name = uname()
    put_each(cluster, name, [make_input(torch.float32, (2,), gen) for _ in range(n)])
    bad_calls = {
        "broadcast src=n": lambda: cluster.broadcast(name, src=n),
        "broadcast src=-1": lambda: cluster.broadcast(name, src=-1),
        "reduce dst=n": lambda: cluster.reduce(name, dst=n),
        "reduce dst=-1": lambda: cluster.reduce(name, dst=-1),
        "gather dst=n+5": lambda: cluster.gather(name, dst=n + 5),
        "get rank=n": lambda: cluster.get(name, rank=n),
        "put rank=n": lambda: cluster.put(name, torch.zeros(1), rank=n),
        "delete rank=-2": lambda: cluster.delete(name, rank=-2),
    }
    for what, call in bad_calls.items():
        err = expect_error(call, grpc.StatusCode.INVALID_ARGUMENT)
        assert any(ch.isdigit() for ch in err.message), f"{what}: name the bad rank: {err}"
    assert_serves(cluster, gen, uname)


@pytest.mark.parametrize("op", ["band", "bor", "bxor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bitwise_op_on_floats_is_invalid_argument(cluster2, gen, uname, op, dtype):
    name = uname()
    inputs = [make_input(dtype, (3,), gen) for _ in range(cluster2.world_size)]
    put_each(cluster2, name, inputs)

    err = expect_error(
        lambda: cluster2.all_reduce(name, op=op, timeout=TIMEOUT_S),
        grpc.StatusCode.INVALID_ARGUMENT,
    )

    assert op in err.message.lower() and "float" in err.message.lower(), err
    for rank, got in enumerate(get_each(cluster2, name)):
        assert_tensor(got, inputs[rank], what=f"rank {rank} must be unchanged")
    assert_serves(cluster2, gen, uname)


def test_avg_on_integers_is_invalid_argument(cluster2, gen, uname):
    name = uname()
    put_each(cluster2, name, [make_input(torch.int64, (3,), gen) for _ in range(2)])
    err = expect_error(
        lambda: cluster2.all_reduce(name, op="avg", timeout=TIMEOUT_S),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "avg" in err.message.lower(), err
    assert_serves(cluster2, gen, uname)


@pytest.mark.parametrize("op", ["median", "SUMM", "", "bitand", 3.5])
def test_unknown_op_name_is_invalid_argument(cluster2, gen, uname, op):
    name = uname()
    cluster2.put(name, make_input(torch.float32, (2,), gen))
    err = expect_error(
        lambda: cluster2.all_reduce(name, op=op, timeout=TIMEOUT_S),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    if isinstance(op, str) and op:
        assert op in err.message, f"the message must name the bad op: {err}"
        # It lists what is valid, so the fix is obvious.
        assert "sum" in err.message.lower(), err
    with pytest.raises(ValueError):
        cluster2.reduce(name, dst=0, op=op)
    assert_serves(cluster2, gen, uname)


@pytest.mark.parametrize(
    "bad",
    ["", "has space", "x" * 257, "caf\u00e9", "semi;colon", "new\nline"],
    ids=["empty", "space", "too-long", "non-ascii", "semicolon", "newline"],
)
def test_bad_tensor_names_are_invalid_argument(cluster2, gen, uname, bad):
    t = make_input(torch.float32, (2,), gen)
    good = uname()
    cluster2.put(good, t)
    for what, call in {
        "put": lambda: cluster2.put(bad, t),
        "get": lambda: cluster2.get(bad, rank=0),
        "all_reduce": lambda: cluster2.all_reduce(bad),
        "all_gather out=": lambda: cluster2.all_gather(good, out=bad),
    }.items():
        err = expect_error(call, grpc.StatusCode.INVALID_ARGUMENT)
        assert "name" in err.message.lower(), f"{what}: {err}"
    assert_serves(cluster2, gen, uname)


def test_per_call_timeout_expiry_is_deadline_exceeded(cluster2, gen, uname):
    name = uname("big")
    cluster2.put(name, torch.randn(16 * 2**20, generator=gen), rank=0)  # 64 MiB
    expect_error(
        lambda: cluster2.get(name, rank=0, timeout=0.001), grpc.StatusCode.DEADLINE_EXCEEDED
    )
    cluster2.delete(name)
    assert_serves(cluster2, gen, uname)


# ------------------------------------------------------------ nothing there


def test_connect_to_nothing_fails_within_its_timeout():
    address = f"127.0.0.1:{free_port()}"
    timeout_s = 3.0
    start = time.monotonic()
    with pytest.raises(collectives.CollectiveError) as info:
        collectives.connect(address, timeout=timeout_s)
    elapsed = time.monotonic() - start
    assert info.value.code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ), info.value
    assert elapsed < timeout_s + 2.0, f"connect() took {elapsed:.1f} s with timeout={timeout_s}"
    assert address in info.value.message or str(address.rsplit(":", 1)[1]) in info.value.message, (
        f"the message should name the address it tried: {info.value}"
    )
