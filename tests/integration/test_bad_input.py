"""The bad-input matrix: malformed and hostile requests over raw gRPC.

Every row is sent with the generated stubs (or, for the hand-framed data plane,
with identity serializers and hand-made byte frames), never through the SDK,
to a real local cluster of 2 workers. Each row names the status code it must
get and a piece of the message that makes the error actionable (the field or
value at fault). After every row each worker process must still be alive and
a valid put/get round trip and an all_reduce (checked against torch) must
still succeed.

The raw framing, channels and health check are in ``raw_grpc``; the delete
racing an op is in test_bad_input_delete_during_op.py.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from helpers import WORKER_TOKEN
from raw_grpc import (
    F32,
    NOT_FOUND,
    PRECONDITION,
    TIMEOUT_S,
    Env,
    chunk_frame,
    header_frame,
    tensor_frames,
)
from raw_grpc import all_reduce as _all_reduce
from raw_grpc import assert_healthy as _assert_healthy
from raw_grpc import opts as _opts
from raw_grpc import stored as _stored
from torch import nn

from collectives.errors import from_rpc_error
from collectives.v1 import coordinator_pb2, tensor_pb2, worker_pb2
from collectives.wire.names import MODEL_METADATA_KEY
from collectives_server.control_protocol import WORKER_TOKEN_METADATA
from collectives_server.membership_digest import membership_digest

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
# The coordinator's worker-only RPCs need the worker token the fixtures' clusters use.
WORKER = ((WORKER_TOKEN_METADATA, WORKER_TOKEN),)
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
DENIED = grpc.StatusCode.PERMISSION_DENIED
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


# ------------------------------------------------------------- model archives
class _Hostile:
    def __reduce__(self):
        return (os.getpid, ())  # unpickling it would call a function


def _export_archive() -> bytes:
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(nn.Linear(3, 2), (torch.randn(2, 3),)), buffer)
    return buffer.getvalue()


def _pickle_archive() -> bytes:
    """A weight stored pickled (``use_pickle``): torch would unpickle it unrestricted.
    (Pickled sample inputs are no longer refused: the worker drops them unread.)"""
    hostile = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(_export_archive())) as src,
        zipfile.ZipFile(hostile, "w") as dst,
    ):
        for info in src.infolist():
            body = src.read(info.filename)
            if info.filename.endswith("model_weights_config.json"):
                config = json.loads(body)
                for meta in config["config"].values():
                    meta["use_pickle"] = True
                body = json.dumps(config).encode()
            elif info.filename.endswith("data/weights/weight_0"):
                evil = io.BytesIO()
                torch.save(_Hostile(), evil)
                body = evil.getvalue()
            dst.writestr(info, body)
    return hostile.getvalue()


def _load_model(e: Env, spec: worker_pb2.ModelSpec, chunks: list[bytes] = ()):
    parts = [worker_pb2.LoadModelRequest(spec=spec)]
    parts += [worker_pb2.LoadModelRequest(archive_chunk=c) for c in chunks]
    return e.stubs[1].LoadModel(iter(parts), timeout=TIMEOUT_S)


def _archive(e: Env, data: bytes, declared: int | None = None):
    spec = worker_pb2.ModelSpec(
        name=e.name("model"), archive_nbytes=len(data) if declared is None else declared
    )
    return _load_model(e, spec, [data])


def _factory(e: Env, factory: str, kwargs: str = "{}"):
    spec = worker_pb2.ModelSpec(name=e.name("model"), factory=factory, factory_kwargs_json=kwargs)
    return _load_model(e, spec)


def _state_dict(e: Env, tensors: dict[str, torch.Tensor]):
    call = e.channels[0].stream_unary(
        "/collectives.v1.Worker/LoadStateDict",
        request_serializer=None,
        response_deserializer=worker_pb2.LoadStateDictResponse.FromString,
    )
    frames = [f for key, t in tensors.items() for f in tensor_frames(key, t)]
    return call(iter(frames), timeout=TIMEOUT_S, metadata=((MODEL_METADATA_KEY, e.model),))


def _good_state(e: Env) -> dict[str, torch.Tensor]:
    return {
        "0.weight": torch.zeros(3, 4),
        "0.bias": torch.zeros(3),
        "2.weight": torch.zeros(3, 3),
        "2.bias": torch.zeros(3),
        "4.weight": torch.zeros(2, 3),
        "4.bias": torch.zeros(2),
    }


# ----------------------------------------------------------------------- rows
@dataclass(frozen=True)
class Row:
    id: str
    call: Callable[[Env], Any]
    code: grpc.StatusCode
    message: str = ""
    # Extra check on the RpcError (trailing metadata) or on the result of an OK row.
    check: Callable[[Env, Any], None] | None = None


def _not_executed(e: Env, err: grpc.RpcError) -> None:
    assert from_rpc_error(err).executed is False, err.trailing_metadata()


def _stale_digest(e: Env) -> str:
    """The digest of the current members in another order: another membership."""
    cluster = e.coordinator.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=10)
    ids = [w.worker_id for w in sorted(cluster.workers, key=lambda w: w.rank) if w.rank >= 0]
    stale = membership_digest(list(reversed(ids)))
    assert stale != e.membership_digest
    return stale


def _path_like_is_an_opaque_key(e: Env, name: str) -> None:
    assert torch.equal(e.get_raw(name), torch.arange(3.0))
    listed = [t.name for t in e.leader.ListTensors(worker_pb2.ListTensorsRequest()).tensors]
    assert name in listed


def _put_path_like(e: Env) -> str:
    name = f"../etc/{e.prefix}/passwd"
    e.put(name, torch.arange(3.0))
    return name


HUGE = 1 << 62
ROWS: list[Row] = [
    # ---------------------------------------------------------- PutTensor headers
    Row("put-dtype-unknown", lambda e: e.put_raw([header_frame(e.name(), 99, [2], 8)]),
        INVALID, "unknown dtype enum value 99"),
    Row("put-dtype-unspecified", lambda e: e.put_raw([header_frame(e.name(), 0, [2], 8)]),
        INVALID, "unknown dtype enum value 0"),
    Row("put-dtype-negative", lambda e: e.put_raw([header_frame(e.name(), -5, [2], 8)]),
        INVALID, "unknown dtype enum value -5"),
    Row("put-shape-negative", lambda e: e.put_raw([header_frame(e.name(), F32, [-1, 4], 16)]),
        INVALID, "negative dimension"),
    Row("put-shape-over-1tib",
        lambda e: e.put_raw([header_frame(e.name(), F32, [1 << 20, 1 << 20], 1 << 42)]),
        INVALID, "the limit is 1099511627776"),
    Row("put-shape-int64-overflow",
        lambda e: e.put_raw([header_frame(e.name(), F32, [HUGE, HUGE], 0)]),
        INVALID, "the limit is"),
    Row("put-too-many-dims", lambda e: e.put_raw([header_frame(e.name(), F32, [1] * 65, 4)]),
        INVALID, "65 dimensions"),
    Row("put-nbytes-mismatch", lambda e: e.put_raw([header_frame(e.name(), F32, [4], 15)]),
        INVALID, "header declares 15 bytes"),
    Row("put-nbytes-negative", lambda e: e.put_raw([header_frame(e.name(), F32, [4], -16)]),
        INVALID, "header declares -16 bytes"),
    # ---------------------------------------------------------- PutTensor streams
    Row("put-data-short",
        lambda e: e.put_raw([header_frame(e.name(), F32, [4], 16), chunk_frame(b"\0" * 8)]),
        INVALID, "ended after 8 of 16"),
    Row("put-data-long",
        lambda e: e.put_raw([header_frame(e.name(), F32, [4], 16), chunk_frame(b"\0" * 20)]),
        INVALID, "exceed the declared 16 bytes"),
    Row("put-data-long-split",
        lambda e: e.put_raw([header_frame(e.name(), F32, [4], 16)] + [chunk_frame(b"\0" * 6)] * 3),
        INVALID, "exceed the declared 16 bytes"),
    Row("put-no-chunks", lambda e: e.put_raw([header_frame(e.name(), F32, [4], 16)]),
        INVALID, "ended after 0 of 16"),
    Row("put-chunk-before-header",
        lambda e: e.put_raw([chunk_frame(b"\0" * 16), header_frame(e.name(), F32, [4], 16)]),
        INVALID, "must start with a header"),
    Row("put-two-headers",
        lambda e: e.put_raw([header_frame(e.name(), F32, [1], 4)] * 2),
        INVALID, "second header"),
    Row("put-empty-stream", lambda e: e.put_raw([]), INVALID, "was empty"),
    Row("put-empty-frame", lambda e: e.put_raw([b""]), INVALID, "was empty"),
    Row("put-truncated-varint", lambda e: e.put_raw([b"\x12\x80"]), INVALID, "truncated varint"),
    Row("put-length-past-end", lambda e: e.put_raw([b"\x12\x10abc"]), INVALID,
        "runs past the end"),
    Row("put-bad-wire-type", lambda e: e.put_raw([b"\x0f\x00"]), INVALID,
        "unsupported wire type 7"),
    Row("put-garbage-header", lambda e: e.put_raw([b"\x0a\x03\xff\xff\xff"]), INVALID,
        "malformed tensor header"),
    Row("put-random-bytes", lambda e: e.put_raw([os.urandom(64) + b"\xff"]), INVALID,
        "malformed"),
    Row("put-empty-tensor-empty-chunk",
        lambda e: e.put_raw([header_frame(e.name("empty"), F32, [0, 3], 0), chunk_frame(b"")]),
        OK),
    # ---------------------------------------------------------------- names
    Row("put-name-empty", lambda e: e.put(" "[:0], torch.ones(1)), INVALID, "must not be empty"),
    Row("put-name-257", lambda e: e.put("n" * 257, torch.ones(1)), INVALID,
        "257 characters long; the limit is 256"),
    Row("put-name-space", lambda e: e.put("a b", torch.ones(1)), INVALID, "contains ' '"),
    Row("put-name-nul", lambda e: e.put("x\0", torch.ones(1)), INVALID, "contains '\\x00'"),
    Row("put-name-unicode", lambda e: e.put("t\u00e9st", torch.ones(1)), INVALID,
        "allowed are A-Z"),
    Row("put-name-path-like-is-opaque", _put_path_like, OK, check=_path_like_is_an_opaque_key),
    Row("get-name-bad",
        lambda e: e.get_raw("../etc passwd"), INVALID, "contains ' '"),
    Row("get-unknown", lambda e: e.get_raw(e.name("missing")), NOT_FOUND, "is not stored"),
    Row("delete-unknown",
        lambda e: e.leader.DeleteTensor(worker_pb2.DeleteTensorRequest(name=e.name("missing"))),
        NOT_FOUND, "is not stored"),
    Row("delete-name-empty",
        lambda e: e.leader.DeleteTensor(worker_pb2.DeleteTensorRequest(name="")),
        INVALID, "must not be empty"),
    # ------------------------------------------------------------ ranks, groups
    Row("broadcast-src-negative",
        lambda e: e.leader.Broadcast(worker_pb2.BroadcastRequest(
            options=_opts(), name=_stored(e, torch.ones(2)), src=-1)),
        INVALID, "src -1 is out of range"),
    Row("broadcast-src-world-size",
        lambda e: e.leader.Broadcast(worker_pb2.BroadcastRequest(
            options=_opts(), name=_stored(e, torch.ones(2)), src=e.world_size)),
        INVALID, "src 2 is out of range"),
    Row("reduce-dst-out-of-range",
        lambda e: e.leader.Reduce(worker_pb2.ReduceRequest(
            options=_opts(), name=_stored(e, torch.ones(2)), dst=7)),
        INVALID, "dst 7 is out of range"),
    Row("gather-dst-negative",
        lambda e: e.leader.Gather(worker_pb2.GatherRequest(
            options=_opts(), name=_stored(e, torch.ones(2)), dst=-1)),
        INVALID, "dst -1 is out of range"),
    Row("new-group-duplicates",
        lambda e: e.leader.NewGroup(worker_pb2.NewGroupRequest(options=_opts(), ranks=[0, 0])),
        INVALID, "ranks must be distinct; repeated: [0]"),
    Row("new-group-empty",
        lambda e: e.leader.NewGroup(worker_pb2.NewGroupRequest(options=_opts(), ranks=[])),
        INVALID, "at least one rank"),
    Row("new-group-out-of-range",
        lambda e: e.leader.NewGroup(worker_pb2.NewGroupRequest(options=_opts(), ranks=[0, 2])),
        INVALID, "rank 2 is out of range"),
    Row("new-group-negative",
        lambda e: e.leader.NewGroup(worker_pb2.NewGroupRequest(options=_opts(), ranks=[-1])),
        INVALID, "rank -1 is out of range"),
    Row("unknown-group",
        lambda e: _all_reduce(e, _stored(e, torch.ones(2)), group_id=987654),
        NOT_FOUND, "group 987654 does not exist"),
    # -------------------------------------------------------------- reduce ops
    Row("band-on-float", lambda e: _all_reduce(e, _stored(e, torch.ones(2)), op=6),
        INVALID, "band is bitwise"),
    Row("bxor-on-complex",
        lambda e: _all_reduce(e, _stored(e, torch.ones(2, dtype=torch.complex64)), op=8),
        INVALID, "bxor is bitwise"),
    Row("avg-on-int", lambda e: _all_reduce(e, _stored(e, torch.ones(2, dtype=torch.int64)), op=5),
        INVALID, "avg needs a floating"),
    Row("max-on-complex",
        lambda e: _all_reduce(e, _stored(e, torch.ones(2, dtype=torch.complex64)), op=4),
        INVALID, "undefined for complex"),
    Row("reduce-op-99", lambda e: _all_reduce(e, _stored(e, torch.ones(2)), op=99),
        INVALID, "unknown reduce op enum value 99"),
    Row("reduce-op-negative", lambda e: _all_reduce(e, _stored(e, torch.ones(2)), op=-3),
        INVALID, "unknown reduce op enum value -3"),
    Row("reduce-scatter-indivisible",
        lambda e: e.leader.ReduceScatter(worker_pb2.ReduceScatterRequest(
            options=_opts(), name=_stored(e, torch.ones(3)))),
        INVALID, "divisible by the group size 2; got 3"),
    Row("all-to-all-0-dim",
        lambda e: e.leader.AllToAll(worker_pb2.AllToAllRequest(
            options=_opts(), name=_stored(e, torch.tensor(1.0)))),
        INVALID, "a 0-dim tensor"),
    # ------------------------------------------------------- operands, routing
    Row("collective-bad-name",
        lambda e: _all_reduce(e, "a b"), INVALID, "contains ' '"),
    Row("collective-bad-out",
        lambda e: e.leader.AllReduce(worker_pb2.AllReduceRequest(
            options=_opts(), name=_stored(e, torch.ones(2)), out="o\0")),
        INVALID, "out name"),
    Row("collective-missing-everywhere", lambda e: _all_reduce(e, e.name("missing")),
        NOT_FOUND, "not found on any rank"),
    Row("collective-missing-on-one-rank",
        lambda e: (lambda n: (e.put(n, torch.ones(2), 0), _all_reduce(e, n)))(e.name()),
        PRECONDITION, "missing on rank(s) 1"),
    Row("collective-shape-disagrees",
        lambda e: (lambda n: (e.put_all(n, [torch.ones(2), torch.ones(3)]), _all_reduce(e, n)))(
            e.name()),
        PRECONDITION, "disagrees across ranks"),
    Row("collective-on-non-leader",
        lambda e: _all_reduce(e, _stored(e, torch.ones(2)), stub=e.stubs[1]),
        UNAVAILABLE, "not the leader", check=_not_executed),
    Row("generation-mismatch",
        lambda e: _all_reduce(e, _stored(e, torch.ones(2)), generation=e.generation + 1000),
        UNAVAILABLE, "generation changed", check=_not_executed),
    # The right generation number with another membership's digest: a forged one,
    # and the digest of a stale membership (the same members in another order).
    Row("membership-digest-forged",
        lambda e: _all_reduce(e, _stored(e, torch.ones(2)), generation=e.generation,
                              membership_digest="0123456789abcdef"),
        UNAVAILABLE, "membership 0123456789abcdef", check=_not_executed),
    Row("membership-digest-stale",
        lambda e: _all_reduce(e, _stored(e, torch.ones(2)), generation=e.generation,
                              membership_digest=_stale_digest(e)),
        UNAVAILABLE, "membership mismatch", check=_not_executed),
    Row("membership-digest-current",
        lambda e: _all_reduce(e, _stored(e, torch.ones(2)), generation=e.generation,
                              membership_digest=e.membership_digest),
        OK, ""),
    # ------------------------------------------------------------------ models
    Row("model-archive-not-zip", lambda e: _archive(e, b"this is not a zip file" * 10),
        INVALID, "not a zip file"),
    Row("model-archive-pickle", lambda e: _archive(e, _pickle_archive()), INVALID, "pickled"),
    Row("model-archive-longer", lambda e: _archive(e, b"PK" * 50, declared=60),
        INVALID, "longer than its declared size"),
    Row("model-archive-shorter", lambda e: _archive(e, b"PK" * 50, declared=400),
        INVALID, "ended after 100 of 400 bytes"),
    Row("model-archive-chunk-first",
        lambda e: e.stubs[0].LoadModel(
            iter([worker_pb2.LoadModelRequest(archive_chunk=b"PK")]), timeout=TIMEOUT_S),
        INVALID, "must start with a spec"),
    Row("model-name-bad",
        lambda e: _load_model(e, worker_pb2.ModelSpec(name="m m", factory="os:getcwd")),
        INVALID, "model name"),
    Row("model-factory-not-allowed", lambda e: _factory(e, "os:system", '{"command": "true"}'),
        DENIED, "--allow-factory"),
    Row("model-factory-malformed", lambda e: _factory(e, "not a factory"),
        INVALID, "'pkg.module:function'"),
    Row("model-factory-kwargs-bad-json",
        lambda e: _factory(e, "collectives_server.model_zoo:mlp", "{in_features: 4"),
        INVALID, "not valid JSON"),
    Row("model-factory-kwargs-not-object",
        lambda e: _factory(e, "collectives_server.model_zoo:mlp", "[4, 3, 2]"),
        INVALID, "must be a JSON object"),
    Row("model-factory-kwargs-wrong",
        lambda e: _factory(e, "collectives_server.model_zoo:mlp", '{"bogus": 1}'),
        INVALID, "rejected its arguments"),
    Row("model-factory-negative-size",
        lambda e: _factory(e, "collectives_server.model_zoo:mlp",
                           '{"in_features": 4, "hidden": -3, "out_features": 2}'),
        INVALID, "hidden must be at least 1, got -3"),
    Row("model-factory-4-tib",
        lambda e: _factory(e, "collectives_server.model_zoo:mlp",
                           '{"in_features": 1048576, "hidden": 1048576, "out_features": 2}'),
        EXHAUSTED, "--max-model-bytes is 4294967296"),
    Row("model-factory-size-overflows",
        lambda e: _factory(e, "collectives_server.model_zoo:mlp",
                           '{"in_features": 4, "hidden": 1e30, "out_features": 2}'),
        INVALID, "hidden must be an integer"),
    Row("forward-unknown-model",
        lambda e: e.leader.Forward(worker_pb2.ForwardRequest(model=e.name("nomodel"), call_id="c")),
        NOT_FOUND, "is not loaded"),
    Row("forward-no-call-id",
        lambda e: e.leader.Forward(worker_pb2.ForwardRequest(model=e.model)),
        INVALID, "call id must not be empty"),
    Row("forward-unknown-input",
        lambda e: e.leader.Forward(worker_pb2.ForwardRequest(
            model=e.model, call_id=e.name("call"),
            args=worker_pb2.Value(tuple=worker_pb2.ValueList(items=[
                worker_pb2.Value(tensor=e.name("nothere"))])),
            kwargs=worker_pb2.Value(dict=worker_pb2.ValueDict()))),
        NOT_FOUND, "is not stored"),
    Row("backward-unknown-call",
        lambda e: e.leader.Backward(worker_pb2.BackwardRequest(model=e.model, call_id="nocall")),
        NOT_FOUND, "no retained graph 'nocall'"),
    Row("load-state-dict-wrong-keys",
        lambda e: _state_dict(e, {"bogus.weight": torch.zeros(1)}),
        INVALID, "unexpected ['bogus.weight']"),
    Row("load-state-dict-wrong-shape",
        lambda e: _state_dict(e, {**_good_state(e), "0.bias": torch.zeros(5)}),
        INVALID, "'0.bias' has shape [5]"),
    Row("load-state-dict-unknown-model",
        lambda e: e.channels[0].stream_unary(
            "/collectives.v1.Worker/LoadStateDict", request_serializer=None,
            response_deserializer=worker_pb2.LoadStateDictResponse.FromString,
        )(iter([]), timeout=TIMEOUT_S, metadata=((MODEL_METADATA_KEY, "nomodel"),)),
        NOT_FOUND, "'nomodel' is not loaded"),
    Row("step-unknown-optimizer",
        lambda e: e.leader.Step(worker_pb2.StepRequest(model=e.model, optimizer="lbfgs2")),
        INVALID, "unknown optimizer 'lbfgs2'"),
    Row("step-unknown-hyperparameter",
        lambda e: e.leader.Step(worker_pb2.StepRequest(
            model=e.model, optimizer="sgd", hyper_json='{"lr": 0.1, "warp": 9}')),
        INVALID, "does not take warp"),
    Row("step-hyper-bad-json",
        lambda e: e.leader.Step(worker_pb2.StepRequest(
            model=e.model, optimizer="sgd", hyper_json="{lr=0.1}")),
        INVALID, "not valid JSON"),
    Row("step-hyper-bad-value",
        lambda e: e.leader.Step(worker_pb2.StepRequest(
            model=e.model, optimizer="sgd", hyper_json='{"lr": -1}')),
        INVALID, "optimizer sgd"),
    # ---------------------------------------------------------- message size
    Row("oversized-put-frame",
        lambda e: e.put_raw([header_frame(e.name(), tensor_pb2.DTYPE_UINT8, [5 << 20], 5 << 20),
                             chunk_frame(b"\0" * (5 << 20))]),
        EXHAUSTED, "larger than max"),
    Row("oversized-unary",
        lambda e: e.leader.DeleteTensor(worker_pb2.DeleteTensorRequest(name="n" * (5 << 20))),
        EXHAUSTED, "larger than max"),
    # --------------------------------------------------- a drain's handoff RPCs
    Row("handoff-not-drained",
        lambda e: e.leader.Handoff(worker_pb2.HandoffRequest(generation_after=99), timeout=2),
        PRECONDITION, "no handoff for generation 99 ready"),
    Row("handoff-tensors-not-drained",
        lambda e: e.leader.HandoffTensors(worker_pb2.HandoffTensorsRequest(
            generation_after=99, items=[worker_pb2.HandoffItem(name="x")]), timeout=10),
        PRECONDITION, "no handoff for generation 99 ready"),
    Row("handoff-tensors-too-many",
        lambda e: e.leader.HandoffTensors(worker_pb2.HandoffTensorsRequest(
            generation_after=99, items=[worker_pb2.HandoffItem(name="x")] * 1025), timeout=10),
        INVALID, "1025 tensors in one HandoffTensors call; at most 1024"),
    Row("handoff-tensors-bad-name",
        lambda e: e.leader.HandoffTensors(worker_pb2.HandoffTensorsRequest(
            generation_after=99, items=[worker_pb2.HandoffItem(name="")]), timeout=10),
        INVALID, "name"),
    # ------------------------------------------------------------- coordinator
    Row("register-no-address",
        lambda e: e.coordinator.Register(
            coordinator_pb2.RegisterRequest(devices=["cpu"]), timeout=10, metadata=WORKER),
        INVALID, "is not HOST:PORT"),
    Row("register-bad-port",
        lambda e: e.coordinator.Register(
            coordinator_pb2.RegisterRequest(address="127.0.0.1:99999", devices=["cpu"]),
            timeout=10, metadata=WORKER),
        INVALID, "'127.0.0.1:99999' is not HOST:PORT"),
    Row("register-no-devices",
        lambda e: e.coordinator.Register(
            coordinator_pb2.RegisterRequest(address="127.0.0.1:1"), timeout=10, metadata=WORKER),
        INVALID, "must be a non-empty list of device names"),
    Row("heartbeat-unknown-id",
        lambda e: e.coordinator.Heartbeat(
            coordinator_pb2.HeartbeatRequest(worker_id="w-nobody"), timeout=10, metadata=WORKER),
        NOT_FOUND, "w-nobody"),
    Row("leave-unknown-id",
        lambda e: e.coordinator.Leave(
            coordinator_pb2.LeaveRequest(worker_id="w-nobody"), timeout=10, metadata=WORKER),
        NOT_FOUND, "w-nobody"),
]  # fmt: skip


def test_matrix_has_at_least_40_rows() -> None:
    assert len(ROWS) >= 40
    assert len({r.id for r in ROWS}) == len(ROWS)
    assert sum(r.code != OK for r in ROWS) >= 40


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(env: Env, row: Row) -> None:
    if row.code == OK:
        result = row.call(env)
        if row.check is not None:
            row.check(env, result)
    else:
        with pytest.raises(grpc.RpcError) as info:
            row.call(env)
        err = info.value
        assert err.code() == row.code, f"{row.id}: {err.code()} {err.details()!r}"
        assert row.message in (err.details() or ""), f"{row.id}: {err.details()!r}"
        if row.check is not None:
            row.check(env, err)
    _assert_healthy(env)
