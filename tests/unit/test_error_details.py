"""Failed calls carry ``google.rpc.Status`` details and the SDK reads them back.

A real server (``rpc.start_server``: the error boundary every daemon sits behind)
on loopback, whose handlers raise :class:`CollectiveError` with structured
fields; the SDK's converter (``call_unary`` → ``from_rpc_error``) must give an
error with the same fields, and a client that only knows grpcio-status must
find the same ``ErrorInfo``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from collectives.errors import (
    ERROR_DOMAIN,
    CollectiveError,
    FailedPrecondition,
    NotFound,
    Reason,
    Unavailable,
    annotate,
    error_for_code,
    from_rpc_error,
)
from collectives.transport.channels import call_unary
from collectives.v1 import worker_pb2
from collectives_server.rpc import server as rpc
from collectives_server.worker.rpc.guards import guard, guard_stream

FIELDS = {
    "op_id": 7,
    "generation": 3,
    "kind": "all_reduce",
    "tensor": "grad",
    "ranks": (0, 2),
    "reason": Reason.OPERAND_MISSING,
    "executed": False,
}
MESSAGE = "op 7 (all_reduce, generation 3): tensor 'grad' is missing on rank(s) 0, 2"


def _rich() -> CollectiveError:
    return FailedPrecondition(MESSAGE, **FIELDS)


def _unary(request, context):
    raise _rich()


def _server_stream(request, context):
    yield worker_pb2.GetStateResponse(worker_id="first")
    raise _rich()


def _client_stream(requests, context):
    for _ in requests:
        pass
    raise _rich()


def _plain(request, context):
    raise NotFound("tensor 'x' is not stored on this worker")


def _with_trailer(request, context):
    context.set_trailing_metadata((("x-extra", "kept"),))
    raise Unavailable("not the leader", executed=False, reason=Reason.NOT_LEADER)


def _boom(request, context):
    raise RuntimeError("/secret/path")


def _foreign(request, context):
    info = error_details_pb2.ErrorInfo(domain="other.example", reason="X")
    info.metadata["op_id"] = "99"
    status = status_pb2.Status(code=grpc.StatusCode.ABORTED.value[0], message="theirs")
    status.details.add().Pack(info)
    context.abort_with_status(rpc_status.to_status(status))


def _garbage(request, context):
    context.abort_with_status(_Status(b"\xff\xfe not a status"))


class _Status(grpc.Status):
    def __init__(self, raw: bytes) -> None:
        self.code = grpc.StatusCode.ABORTED
        self.details = "garbage details"
        self.trailing_metadata = (("grpc-status-details-bin", raw),)


class _Servicer:
    """A servicer behind the worker's guard decorators (what worker RPCs use)."""

    @guard
    def get(self, request, context):
        raise NotFound(f"tensor {request.name!r} is not stored on this worker")

    @guard_stream
    def get_stream(self, request, context) -> Iterator[worker_pb2.GetStateResponse]:
        yield worker_pb2.GetStateResponse(worker_id="first")
        raise NotFound("gone", tensor="inner", kind="get")


def _register(server: grpc.Server) -> None:
    state = worker_pb2.GetStateRequest.FromString
    get = worker_pb2.GetTensorRequest.FromString
    write = worker_pb2.GetStateResponse.SerializeToString
    servicer = _Servicer()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, state, write),
        "ServerStream": grpc.unary_stream_rpc_method_handler(_server_stream, state, write),
        "ClientStream": grpc.stream_unary_rpc_method_handler(_client_stream, state, write),
        "Plain": grpc.unary_unary_rpc_method_handler(_plain, state, write),
        "Trailer": grpc.unary_unary_rpc_method_handler(_with_trailer, state, write),
        "Boom": grpc.unary_unary_rpc_method_handler(_boom, state, write),
        "Foreign": grpc.unary_unary_rpc_method_handler(_foreign, state, write),
        "Garbage": grpc.unary_unary_rpc_method_handler(_garbage, state, write),
        "Get": grpc.unary_unary_rpc_method_handler(servicer.get, get, write),
        "GetStream": grpc.unary_stream_rpc_method_handler(servicer.get_stream, get, write),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Test", handlers),))


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    handle = rpc.start_server("127.0.0.1", 0, [_register], ["t.Test"], max_workers=4)
    chan = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield chan
    chan.close()
    handle.stop(0.5)


def _method(channel: grpc.Channel, name: str, kind: str = "unary_unary"):
    return getattr(channel, kind)(
        f"/t.Test/{name}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=worker_pb2.GetStateResponse.FromString,
    )


def _sdk_error(channel: grpc.Channel, name: str, request=None) -> CollectiveError:
    """The error the SDK raises for a unary call (its one converter)."""
    with pytest.raises(CollectiveError) as info:
        call_unary(_method(channel, name), request or worker_pb2.GetStateRequest(), 10, name)
    return info.value


def _rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _assert_rich(err: CollectiveError) -> None:
    assert isinstance(err, FailedPrecondition)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and err.message == MESSAGE
    assert str(err) == f"FAILED_PRECONDITION: {MESSAGE}"
    assert err.fields() == FIELDS
    assert err.reason == "OPERAND_MISSING" and type(err.reason) is str


def test_unary_error_fields_round_trip(channel) -> None:
    _assert_rich(_sdk_error(channel, "Unary"))


def test_streaming_errors_carry_the_same_details(channel) -> None:
    request = worker_pb2.GetStateRequest()
    server_stream = _method(channel, "ServerStream", "unary_stream")
    _assert_rich(from_rpc_error(_rpc_error(lambda: list(server_stream(request, timeout=10)))))
    client_stream = _method(channel, "ClientStream", "stream_unary")
    _assert_rich(from_rpc_error(_rpc_error(lambda: client_stream(iter([request]), timeout=10))))


def test_other_clients_read_the_error_info(channel) -> None:
    err = _rpc_error(lambda: _method(channel, "Unary")(worker_pb2.GetStateRequest(), timeout=10))
    assert all(key != "collectives-executed" for key, _ in err.trailing_metadata())
    status = rpc_status.from_call(err)
    assert status is not None and status.message == MESSAGE
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    assert info.domain == ERROR_DOMAIN and info.reason == "OPERAND_MISSING"
    assert dict(info.metadata) == {
        "op_id": "7",
        "generation": "3",
        "kind": "all_reduce",
        "tensor": "grad",
        "ranks": "0,2",
        "executed": "no",
    }


def test_an_error_without_fields_has_none_of_them(channel) -> None:
    err = _sdk_error(channel, "Plain")
    assert (
        isinstance(err, NotFound)
        and str(err) == "NOT_FOUND: tensor 'x' is not stored on this worker"
    )
    assert (err.op_id, err.generation, err.kind, err.tensor, err.reason) == (None,) * 5
    assert err.ranks == () and err.executed is None


def test_trailers_set_before_the_error_are_kept(channel) -> None:
    err = _rpc_error(lambda: _method(channel, "Trailer")(worker_pb2.GetStateRequest(), timeout=10))
    assert ("x-extra", "kept") in err.trailing_metadata()
    sdk = from_rpc_error(err)
    assert isinstance(sdk, Unavailable) and sdk.executed is False and sdk.reason == "NOT_LEADER"


def test_internal_errors_carry_no_details_and_no_internals(channel) -> None:
    err = _rpc_error(lambda: _method(channel, "Boom")(worker_pb2.GetStateRequest(), timeout=10))
    assert err.code() == grpc.StatusCode.INTERNAL and "/secret" not in err.details()
    assert rpc_status.from_call(err) is None
    sdk = from_rpc_error(err)
    assert sdk.fields() == dict.fromkeys(FIELDS) | {"ranks": ()}


@pytest.mark.parametrize("method", ["Foreign", "Garbage"])
def test_details_that_are_not_ours_are_ignored(channel, method) -> None:
    err = _sdk_error(channel, method)
    assert err.code == grpc.StatusCode.ABORTED and isinstance(err, Unavailable)
    assert err.op_id is None and err.reason is None and err.ranks == ()


def test_malformed_requests_say_so_in_the_reason(channel) -> None:
    raw = channel.unary_unary("/t.Test/Plain")
    err = from_rpc_error(_rpc_error(lambda: raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == "MALFORMED_REQUEST"


def test_the_worker_guards_name_the_requests_tensor(channel) -> None:
    request = worker_pb2.GetTensorRequest(name="missing")
    err = _sdk_error(channel, "Get", request)
    assert isinstance(err, NotFound) and err.tensor == "missing" and err.kind is None
    stream = _method(channel, "GetStream", "unary_stream")
    err = from_rpc_error(_rpc_error(lambda: list(stream(request, timeout=10))))
    # What the servicer set wins over what the guard knows.
    assert err.tensor == "inner" and err.kind == "get"


def test_with_context_fills_only_unset_fields() -> None:
    err = Unavailable("peer lost", generation=4)
    same = err.with_context(op_id=9, generation=5, ranks=[1], reason=Reason.PEER_LOST)
    assert same is err
    assert (err.op_id, err.generation, err.ranks, err.reason) == (9, 4, (1,), "PEER_LOST")
    assert repr(err) == (
        "Unavailable(code=UNAVAILABLE, message='peer lost', generation=4, op_id=9, "
        "ranks=(1,), reason='PEER_LOST')"
    )


def test_error_for_code_and_annotate_keep_the_fields() -> None:
    err = error_for_code(grpc.StatusCode.NOT_FOUND, "gone", **FIELDS)
    assert isinstance(err, NotFound) and err.fields() == FIELDS
    annotated = annotate(err, "get on rank 0")
    assert annotated.message == "get on rank 0: gone" and annotated.fields() == FIELDS
    # The old constructor keeps working.
    old = Unavailable("x", grpc.StatusCode.ABORTED, executed=False)
    assert old.code == grpc.StatusCode.ABORTED and old.executed is False and old.ranks == ()
