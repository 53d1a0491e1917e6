"""The caps on client-chosen sizes, and the error boundary.

Codec shape and allocation bounds, the namedtuple type cache, bounded JSON, the
classification of collective failures, and a real gRPC server (built by
``rpc.start_server``) whose handlers fail in every way a servicer can.
"""

from __future__ import annotations

import gc
import json
import logging
import re

import grpc
import pytest
import torch
from helpers import wait_until

from collectives.errors import InvalidArgument, NotFound, ResourceExhausted
from collectives.v1 import tensor_pb2, worker_pb2
from collectives.wire import codec
from collectives.wire import pytree as _pytree
from collectives.wire.op_specs import spec_named
from collectives_server.json_input import MAX_JSON_DEPTH, json_depth, parse_json, parse_json_object
from collectives_server.rpc import server as rpc
from collectives_server.worker.engine import validation
from collectives_server.worker.engine.group_cap import check_group_cap, subgroup_count
from collectives_server.worker.kernels import op_failures

F32 = tensor_pb2.DTYPE_FLOAT32


# ---------------------------------------------------------------------- codec
@pytest.mark.parametrize(
    "shape",
    [[0, 1 << 62, 1 << 62], [1 << 24, 1 << 24, 2], [0] * 3 + [1 << 49], [2] * 65, [3, -1]],
    ids=["h8", "over-2^48", "zeros-then-huge", "65-dims", "negative"],
)
def test_absurd_shapes_are_invalid_argument_even_with_zero_bytes(shape) -> None:
    with pytest.raises(InvalidArgument):
        codec.check_shape(shape)
    header = tensor_pb2.TensorHeader(name="t", dtype=F32, shape=shape, nbytes=0)
    with pytest.raises(InvalidArgument):
        codec.check_header(header)


def test_shapes_at_the_bound_are_accepted() -> None:
    assert codec.check_shape([0, 1 << 24, 1 << 24]) == (0, 1 << 24, 1 << 24)
    assert codec.check_shape([1] * 64) == (1,) * 64
    meta = codec.check_header(tensor_pb2.TensorHeader(name="e", dtype=F32, shape=[0, 1 << 40]))
    assert meta.nbytes == 0


def test_allocate_bytes_refuses_absurd_and_impossible_sizes() -> None:
    with pytest.raises(InvalidArgument):
        codec.allocate_bytes(codec.MAX_TENSOR_BYTES + 1)
    with pytest.raises(InvalidArgument):
        codec.allocate_bytes(-1)
    with pytest.raises(ResourceExhausted) as info:
        codec.allocate_bytes(10**12)  # 1 TB: more than this host has
    assert str(10**12) in info.value.message


def test_allocate_bytes_gives_a_writable_buffer(gen) -> None:
    data = torch.randint(0, 256, (4097,), dtype=torch.uint8, generator=gen)
    buffer = codec.allocate_bytes(4097)
    buffer.copy_(data)
    assert torch.equal(buffer, data)


# --------------------------------------------------------------------- pytree
def _nt_value(type_name: str, fields: list[str]) -> worker_pb2.Value:
    return worker_pb2.Value(
        named_tuple=worker_pb2.NamedTupleValue(
            type_name=type_name,
            fields=fields,
            values=[worker_pb2.Value(float_value=float(i)) for i in range(len(fields))],
        )
    )


@pytest.mark.parametrize(
    "type_name, fields",
    [
        ("T", [f"f{i}" for i in range(257)]),
        ("T", [f"f{i}" for i in range(50_000)]),
        ("T", ["1x"]),
        ("T", ["for"]),
        ("T", ["_x"]),
        ("T", ["a", "a"]),
        ("T", ["a" * 129]),
        ("T" * 129, ["a"]),
        ("not an identifier", ["a"]),
        ("", ["a"]),
    ],
)
def test_bad_namedtuple_types_are_invalid_argument(type_name, fields) -> None:
    with pytest.raises(InvalidArgument):
        _pytree.from_value(_nt_value(type_name, fields), lambda name: torch.empty(0))


def test_namedtuple_values_must_match_their_fields() -> None:
    value = _nt_value("P", ["x", "y"])
    del value.named_tuple.values[1]
    with pytest.raises(InvalidArgument, match="2 fields but 1 values"):
        _pytree.from_value(value, lambda name: torch.empty(0))


def test_namedtuple_type_cache_is_a_bounded_lru() -> None:
    first = _pytree.namedtuple_class("Keep", ("a", "b"))
    for i in range(_pytree.MAX_NAMEDTUPLE_TYPES * 2):
        _pytree.namedtuple_class(f"Cap{i}", (f"x{i}", "y"))
        if i % 16 == 0:  # used again: stays in the cache
            assert _pytree.namedtuple_class("Keep", ("a", "b")) is first
    assert len(_pytree._NAMEDTUPLES) <= _pytree.MAX_NAMEDTUPLE_TYPES
    assert _pytree.namedtuple_class("Keep", ("a", "b")) is first
    point = _pytree.from_value(_nt_value("Point", ["x", "y"]), lambda name: torch.empty(0))
    assert type(point).__name__ == "Point" and point == (0.0, 1.0)
    private = _pytree.from_value(_nt_value("_Out", ["a"]), lambda name: torch.empty(0))
    assert type(private).__name__ == "_Out"  # Python allows a private type name


def test_evicted_namedtuple_types_are_freed() -> None:
    fields = tuple(f"f{j}" for j in range(_pytree.MAX_NAMEDTUPLE_FIELDS))

    def fill(round_: int) -> int:
        for i in range(_pytree.MAX_NAMEDTUPLE_TYPES):
            _pytree.namedtuple_class(f"R{round_}_{i}", fields)
        gc.collect()
        return len(gc.get_objects())

    gc.collect()
    before = len(gc.get_objects())
    one_cache = fill(0) - before  # a full cache of the largest types allowed
    for round_ in (1, 2):
        fill(round_)
    after_four = fill(3) - before
    assert one_cache > 0
    assert after_four < 1.2 * one_cache, (one_cache, after_four)


# ----------------------------------------------------------------------- json
def test_json_depth_ignores_brackets_in_strings() -> None:
    assert json_depth('{"a": "[[[[{{{{"}') == 1
    assert json_depth('[[["\\"]]]"]]]') == 3
    assert json_depth("") == 0


def test_json_nested_50k_deep_is_invalid_argument_without_recursing() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    with pytest.raises(InvalidArgument, match="nested 50000 deep"):
        parse_json(deep, "factory kwargs")
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(ok, "x") is not None
    with pytest.raises(InvalidArgument):
        parse_json("[" + ok + "]", "x")


def test_json_size_and_syntax_errors_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="at most 1048576"):
        parse_json(json.dumps({"pad": "x" * (1 << 20)}), "kwargs")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_json("{'a': 1}", "kwargs")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_json("1" * 5000, "kwargs")  # over Python's int digit limit
    with pytest.raises(InvalidArgument, match="UTF-8"):
        parse_json(b"\xff\xfe", "kwargs")
    with pytest.raises(InvalidArgument, match="must be a JSON object"):
        parse_json_object("[1]", "kwargs")
    assert parse_json_object("", "kwargs") == {}
    assert parse_json_object('{"lr": 0.5}', "kwargs") == {"lr": 0.5}


# ------------------------------------------------------------------ op failures
@pytest.mark.parametrize(
    "text",
    [
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:4021",
        "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv",
        "Read error [127.0.0.1]:1234: Connection reset by peer",
        "NCCL error in: ..., unhandled system error",
    ],
)
def test_transport_failures_break_the_group(text) -> None:
    assert op_failures.is_transport_failure(RuntimeError(text))
    message = op_failures.backend_message(RuntimeError(text))
    assert ".cc" not in message and "/pytorch" not in message


@pytest.mark.parametrize(
    "exc, code",
    [
        (RuntimeError("Invalid scalar type"), grpc.StatusCode.INVALID_ARGUMENT),
        (
            RuntimeError("Cannot use ReduceOp.BAND with non-integral dtype"),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (RuntimeError("numel: integer multiplication overflow"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (MemoryError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (KeyError("/usr/lib/secret.py"), grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_local_failures_fail_the_op_only_with_a_clean_message(exc, code) -> None:
    assert not op_failures.is_transport_failure(exc)
    got, message = op_failures.local_failure(exc, "all_reduce", torch.int16)
    assert got == code
    assert "/usr/lib" not in message and "Error:" not in message and "Traceback" not in message


def test_group_cap() -> None:
    check_group_cap(subgroup_count({0: None, 1: None}), 2, 7)
    with pytest.raises(ResourceExhausted, match="--max-groups 2"):
        check_group_cap(subgroup_count({0: None, 1: None, 2: None}), 2, 7)


# --------------------------------------------------------------- rpc boundary
_SECRET = "secret-detail /usr/lib/python3/site.py"


def _boom(request, context):
    raise RuntimeError(_SECRET)


def _boom_stream(request, context):
    yield worker_pb2.GetStateResponse(worker_id="first")
    raise KeyError(_SECRET)


def _known(request, context):
    raise NotFound("tensor 'x' not found")


def _echo(request, context):
    return worker_pb2.GetStateResponse(worker_id=request.SerializeToString().hex() or "empty")


def _register(server: grpc.Server) -> None:
    parse = worker_pb2.GetStateRequest.FromString
    write = worker_pb2.GetStateResponse.SerializeToString
    handlers = {
        "Boom": grpc.unary_unary_rpc_method_handler(_boom, parse, write),
        "BoomStream": grpc.unary_stream_rpc_method_handler(_boom_stream, parse, write),
        "Known": grpc.unary_unary_rpc_method_handler(_known, parse, write),
        "Echo": grpc.unary_unary_rpc_method_handler(_echo, parse, write),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Test", handlers),))


@pytest.fixture(scope="module")
def server():
    handle = rpc.start_server("127.0.0.1", 0, [_register], ["t.Test"], max_workers=4)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield channel
    channel.close()
    handle.stop(0.5)


def _call(channel, method, payload=b"", stream=False):
    kind = channel.unary_stream if stream else channel.unary_unary
    call = kind(f"/t.Test/{method}", response_deserializer=worker_pb2.GetStateResponse.FromString)
    result = call(payload, timeout=10)
    return list(result) if stream else result


def test_unexpected_exceptions_are_internal_with_only_an_id(server, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="collectives_server.rpc.errors")
    for method, stream in (("Boom", False), ("BoomStream", True)):
        with pytest.raises(grpc.RpcError) as info:
            _call(server, method, stream=stream)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        details = info.value.details()
        match = re.fullmatch(r"internal error \(id ([0-9a-f]{12})\)", details)
        assert match, details
        error_id = match.group(1)
        wait_until(  # the server logs from its own thread
            lambda error_id=error_id: error_id in caplog.text,
            5,
            f"the log line of error {error_id}",
            interval_s=0.01,
        )
        assert "secret-detail" in caplog.text


def test_known_errors_keep_their_status_and_message(server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(server, "Known")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "tensor 'x' not found"


def test_undecodable_requests_are_invalid_argument_and_valid_ones_served(server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(server, "Echo", b"\x0a\xff\xff\xff\xff\x0f")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "Echo: malformed request (the message does not decode)"
    assert _call(server, "Echo", b"").worker_id == "empty"


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("kind", ["all_gather", "gather", "all_reduce", "broadcast"])
def test_an_operand_with_absurd_dims_fails_the_op_on_every_rank_alike(kind) -> None:
    """Defence in depth behind the put-time check: a stored tensor with absurd dims
    (however it got there) is refused from the exchanged infos, before data moves."""
    info = validation.OperandInfo(validation.PRESENT, torch.float32, (0, 1 << 62, 1 << 62))
    verdict = validation.decide(spec_named(kind), "t", [0, 1], [info, info])
    assert isinstance(verdict, validation.OpError)
    assert verdict.code == grpc.StatusCode.INVALID_ARGUMENT and "absurd" in verdict.message
    # All-gathering 2^48 elements over 2 ranks would be 2^49: refused too; all_reduce is not.
    edge = validation.OperandInfo(validation.PRESENT, torch.float32, (0, 1 << 24, 1 << 24))
    verdict = validation.decide(spec_named(kind), "t", [0, 1], [edge, edge])
    gathers = kind in ("all_gather", "gather")
    assert isinstance(verdict, validation.OpError) == gathers


def test_health_watches_still_hold_no_server_thread() -> None:
    """grpc's health Watch answers through a callback (experimental_non_blocking); the
    boundary must keep it that way, or each idle watcher would hold a pool thread."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    handle = rpc.start_server("127.0.0.1", 0, [_register], ["t.Test"], max_workers=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [
            stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60) for _ in range(4)
        ]
        for watch in watches:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        # Blocking watchers would hold both threads until their 60 s deadline.
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert _call(channel, "Echo", b"").worker_id == "empty"
        for watch in watches:
            watch.cancel()
    finally:
        channel.close()
        handle.stop(0.5)
