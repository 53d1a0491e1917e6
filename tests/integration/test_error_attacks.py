"""Errors that reveal nothing and break nothing: oversized namedtuple types, absurd
dims, unbounded sub-groups, and malformed input of every kind.

Each attack is sent over raw gRPC to a real local cluster, exactly as an
attacker would, and must get its status with a message free of internals (no
traceback, file path or exception class name); afterwards every daemon is
healthy within 1 s, its RSS is back to baseline and the tensors stored before
are intact (:class:`hostile.Aftermath`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid

import grpc
import pytest
import torch
from helpers import wait_until
from hostile import Aftermath

from collectives.v1 import coordinator_pb2, tensor_pb2, worker_pb2, worker_pb2_grpc

TIMEOUT_S = 30.0
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
ZOO = "collectives_server.model_zoo"

_INTERNALS = (
    re.compile(r"Traceback"),
    re.compile(r"File \""),
    re.compile(r"\.py\b"),
    re.compile(r"/(?:usr|home|work|opt|root|var|lib|proc|srv)/"),  # a file path
    re.compile(r"\.(?:cc|cpp|so)\b"),
    re.compile(r"\b\w*(?:Error|Exception):"),  # a Python class name as a prefix
)


def assert_clean(details: str | None) -> None:
    """A message a client may see: something, and nothing of the server's insides."""
    assert details, "the error has no message"
    for pattern in _INTERNALS:
        assert not pattern.search(details), f"internals in {details!r} ({pattern.pattern})"


def expect_status(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, f"expected {code.name}, got {err.code()} {err.details()!r}"
    assert_clean(err.details())
    return err.details()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def header_frame(name: str, dtype: int, shape: list[int], nbytes: int) -> bytes:
    body = tensor_pb2.TensorHeader(
        name=name, dtype=dtype, shape=shape, nbytes=nbytes
    ).SerializeToString()
    return b"\x0a" + _varint(len(body)) + body


def put_raw(channel: grpc.Channel, frames: list[bytes]):
    call = channel.stream_unary(
        "/collectives.v1.Worker/PutTensor",
        request_serializer=None,
        response_deserializer=worker_pb2.PutTensorResponse.FromString,
    )
    return call(iter(frames), timeout=TIMEOUT_S)


class Raw:
    """Raw channels to every member of a connected cluster, in rank order."""

    def __init__(self, cluster) -> None:
        members = sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)
        self.pids = [w.pid for w in members]
        self.channels = [grpc.insecure_channel(w.address) for w in members]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.prefix = f"err{uuid.uuid4().hex[:8]}"

    def close(self) -> None:
        for c in self.channels:
            c.close()


@pytest.fixture
def raw(cluster2):
    r = Raw(cluster2)
    yield r
    r.close()


def _mlp(cluster, name: str) -> None:
    cluster.load_model(
        name, factory=f"{ZOO}:mlp", kwargs={"in_features": 4, "hidden": 3, "out_features": 2}
    )


def _forward(stub, model: str, value: worker_pb2.Value):
    request = worker_pb2.ForwardRequest(
        model=model,
        call_id=uuid.uuid4().hex,
        args=worker_pb2.Value(tuple=worker_pb2.ValueList(items=[value])),
    )
    return stub.Forward(request, timeout=TIMEOUT_S)


def _namedtuple(type_name: str, fields: list[str]) -> worker_pb2.Value:
    return worker_pb2.Value(
        named_tuple=worker_pb2.NamedTupleValue(
            type_name=type_name,
            fields=fields,
            values=[worker_pb2.Value(int_value=i) for i in range(len(fields))],
        )
    )


# ------------------------------------------------- namedtuple types of any size
def test_namedtuple_types_with_50000_fields_are_refused_and_memory_stays(
    cluster2, raw, uname
) -> None:
    model = uname("fields")
    _mlp(cluster2, model)
    after = Aftermath(cluster2).capture()
    fields = [f"f{i}" for i in range(50_000)]
    for i in range(4):
        details = expect_status(
            lambda i=i: _forward(raw.stubs[0], model, _namedtuple(f"T{i}", fields)), INVALID
        )
        assert "at most 256" in details
    # Many distinct small types are served, and the cache of their classes stays bounded.
    for i in range(300):
        value = _namedtuple(f"Small{i}", [f"a{i}", f"b{i}"])
        with pytest.raises(grpc.RpcError) as info:  # the mlp cannot take a namedtuple
            _forward(raw.stubs[1], model, value)
        assert info.value.code() == INVALID
        assert_clean(info.value.details())
    after.check(rss_slack_bytes=48 << 20)
    cluster2.unload_model(model)


# --------------------------------------------------------------- absurd dims
def test_absurd_dims_are_refused_at_the_put_and_the_group_stays(cluster2, raw, gen) -> None:
    after = Aftermath(cluster2).capture()
    generation = cluster2.generation
    name = f"{raw.prefix}/dims"
    ok = f"{raw.prefix}/ok"
    for rank in range(cluster2.world_size):
        cluster2.put(ok, torch.randn(1024, generator=gen), rank=rank)
    start = time.monotonic()
    cluster2.all_reduce(ok, timeout=TIMEOUT_S)
    unloaded_s = time.monotonic() - start

    frame = header_frame(name, tensor_pb2.DTYPE_FLOAT32, [0, 1 << 62, 1 << 62], 0)
    for channel in raw.channels:
        details = expect_status(lambda channel=channel: put_raw(channel, [frame]), INVALID)
        assert "absurd" in details
    # Nothing was stored, so the collective the attack needed is NOT_FOUND, not a broken group.
    expect_status(
        lambda: raw.stubs[0].AllGather(worker_pb2.AllGatherRequest(name=name), timeout=TIMEOUT_S),
        grpc.StatusCode.NOT_FOUND,
    )
    inputs = [torch.randn(1024, generator=gen) for _ in range(cluster2.world_size)]
    for rank, t in enumerate(inputs):
        cluster2.put(ok, t, rank=rank)
    start = time.monotonic()
    cluster2.all_reduce(ok, timeout=TIMEOUT_S)
    took_s = time.monotonic() - start
    assert cluster2.generation == generation, "the group was torn down and rebuilt"
    assert took_s < max(1.0, 5 * unloaded_s), f"all_reduce took {took_s:.2f} s after the attack"
    torch.testing.assert_close(cluster2.get(ok, rank=1), sum(inputs))
    after.check()


def test_a_dtype_gloo_cannot_reduce_fails_the_op_only(cluster2, raw, gen) -> None:
    """int16 reductions: gloo has no kernel ("Invalid scalar type"). Operands above the
    inline size reach gloo: the op is INVALID_ARGUMENT and the group stays."""
    after = Aftermath(cluster2).capture()
    generation = cluster2.generation
    name = f"{raw.prefix}/i16"
    for rank in range(cluster2.world_size):
        t = torch.randint(-1000, 1000, (64 * 1024,), dtype=torch.int16, generator=gen)
        cluster2.put(name, t, rank=rank)
    details = expect_status(
        lambda: raw.stubs[0].AllReduce(worker_pb2.AllReduceRequest(name=name), timeout=TIMEOUT_S),
        INVALID,
    )
    assert "int16" in details and "not supported" in details
    ok = f"{raw.prefix}/after"
    inputs = [torch.randn(4096, generator=gen) for _ in range(cluster2.world_size)]
    for rank, t in enumerate(inputs):
        cluster2.put(ok, t, rank=rank)
    start = time.monotonic()
    cluster2.all_reduce(ok, timeout=TIMEOUT_S)
    assert time.monotonic() - start < 2.0
    assert cluster2.generation == generation
    torch.testing.assert_close(cluster2.get(ok, rank=0), sum(inputs))
    after.check()


# ------------------------------------------ sub-groups capped, freed with their generation
def _fds_threads(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def test_new_group_is_capped_and_groups_are_freed_with_their_generation(fresh_cluster):
    _local, cluster = fresh_cluster(
        3, "--min-workers", "2", "--max-groups", "6", "--max-restarts", "0"
    )
    after = Aftermath(cluster).capture()
    members = sorted((w for w in cluster.workers() if w.rank >= 0), key=lambda w: w.rank)
    survivors = [w.pid for w in members[:2]]
    generation = cluster.generation
    before = {pid: _fds_threads(pid) for pid in survivors}
    for i in range(6):
        cluster.new_group([0, 1, 2] if i % 2 else [0, 1], timeout=TIMEOUT_S)
    grown = {pid: _fds_threads(pid) for pid in survivors}
    with grpc.insecure_channel(members[0].address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        details = expect_status(
            lambda: stub.NewGroup(worker_pb2.NewGroupRequest(ranks=[0, 1]), timeout=TIMEOUT_S),
            EXHAUSTED,
        )
    assert "--max-groups 6" in details
    with pytest.raises(Exception) as info:
        cluster.new_group([1, 2], timeout=TIMEOUT_S)
    assert getattr(info.value, "code", None) == EXHAUSTED
    after.check()
    for pid in survivors:
        assert grown[pid][0] > before[pid][0] and grown[pid][1] > before[pid][1], (before, grown)

    # The generation ends (a worker leaves): its groups, their sockets and threads go.
    os.kill(members[2].pid, signal.SIGTERM)
    wait_until(
        lambda: cluster.generation > generation and cluster.world_size == 2,
        30.0,
        "a new generation of the 2 survivors",
    )

    def freed() -> bool:
        now = {pid: _fds_threads(pid) for pid in survivors}
        return all(
            now[pid][0] <= before[pid][0] + 4 and now[pid][1] <= before[pid][1] + 2
            for pid in survivors
        )

    wait_until(freed, 30.0, f"fds/threads back to {before} (grown to {grown})")
    # And the new generation can make groups again.
    cluster.new_group([0, 1], timeout=TIMEOUT_S)


# ----------------------------------------------------------- malformed input
def test_a_1tb_put_without_a_quota_is_resource_exhausted(cluster2, raw) -> None:
    after = Aftermath(cluster2).capture()
    nbytes = 10**12
    frame = header_frame(f"{raw.prefix}/tb", tensor_pb2.DTYPE_UINT8, [nbytes], nbytes)
    details = expect_status(lambda: put_raw(raw.channels[0], [frame]), EXHAUSTED)
    assert str(nbytes) in details
    bulk = worker_pb2.PutTensorBulkRequest(
        header=tensor_pb2.TensorHeader(
            name=f"{raw.prefix}/tb-bulk",
            dtype=tensor_pb2.DTYPE_UINT8,
            shape=[nbytes],
            nbytes=nbytes,
        ),
        ticket=os.urandom(16),
    )
    details = expect_status(lambda: raw.stubs[1].PutTensorBulk(bulk, timeout=TIMEOUT_S), EXHAUSTED)
    assert str(nbytes) in details
    after.check()


def test_nul_in_a_shm_path_is_invalid_argument(cluster2, raw) -> None:
    after = Aftermath(cluster2).capture()
    request = worker_pb2.PutTensorShmRequest(
        header=tensor_pb2.TensorHeader(
            name=f"{raw.prefix}/shm", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4], nbytes=16
        ),
        path="/dev/shm/collectives-\x00x",
    )
    details = expect_status(lambda: raw.stubs[0].PutTensorShm(request, timeout=TIMEOUT_S), INVALID)
    assert "NUL" in details
    after.check()


@pytest.mark.parametrize(
    "type_name, fields, expected",
    [
        ("Bad", ["1x", "y"], "not a valid Python identifier"),
        ("Bad", ["class", "y"], "not a valid Python identifier"),
        ("Bad", ["_x"], "underscore"),
        ("Bad", ["x", "x"], "repeats"),
        ("Bad", ["x" * 129], "at most 128"),
        ("has space", ["x"], "not a valid Python identifier"),
    ],
    ids=["digit", "keyword", "underscore", "duplicate", "long", "type-name"],
)
def test_bad_namedtuple_fields_are_invalid_argument(
    cluster2, raw, uname, type_name, fields, expected
) -> None:
    model = uname("nt")
    _mlp(cluster2, model)
    after = Aftermath(cluster2).capture()
    details = expect_status(
        lambda: _forward(raw.stubs[0], model, _namedtuple(type_name, fields)), INVALID
    )
    assert expected in details
    after.check()
    cluster2.unload_model(model)


def test_json_nested_50k_deep_is_invalid_argument(cluster2, raw, uname) -> None:
    after = Aftermath(cluster2).capture()
    deep = '{"a":' * 50_000 + "1" + "}" * 50_000
    huge = json.dumps({"in_features": 4, "pad": "x" * (2 << 20)})
    for kwargs, expected in ((deep, "nested 50000 deep"), (huge, "at most 1048576")):
        spec = worker_pb2.ModelSpec(
            name=uname("json"), factory=f"{ZOO}:mlp", factory_kwargs_json=kwargs
        )
        details = expect_status(
            lambda spec=spec: raw.stubs[0].LoadModel(
                iter([worker_pb2.LoadModelRequest(spec=spec)]), timeout=TIMEOUT_S
            ),
            INVALID,
        )
        assert expected in details
    model = uname("json-step")
    _mlp(cluster2, model)
    step = worker_pb2.StepRequest(model=model, optimizer="sgd", hyper_json=deep)
    details = expect_status(lambda: raw.stubs[0].Step(step, timeout=TIMEOUT_S), INVALID)
    assert "optimizer hyperparameters" in details and "nested 50000 deep" in details
    cluster2.unload_model(model)
    after.check()


def test_undecodable_protobuf_is_invalid_argument_on_every_server(
    cluster2, cluster2_address, raw
) -> None:
    after = Aftermath(cluster2).capture()
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # a length-delimited field running past the end
    with grpc.insecure_channel(cluster2_address) as coordinator:
        calls = [
            raw.channels[0].unary_unary("/collectives.v1.Worker/GetState"),
            raw.channels[1].unary_unary("/collectives.v1.Worker/AllReduce"),
            raw.channels[0].unary_unary("/collectives.v1.Worker/Forward"),
            coordinator.unary_unary("/collectives.v1.Coordinator/GetCluster"),
        ]
        for call in calls:
            details = expect_status(lambda call=call: call(garbage, timeout=TIMEOUT_S), INVALID)
            assert "malformed request" in details
        # Streaming both ways: a server stream (WatchCluster), a client stream (LoadModel).
        watch = coordinator.unary_stream("/collectives.v1.Coordinator/WatchCluster")
        details = expect_status(lambda: list(watch(garbage, timeout=TIMEOUT_S)), INVALID)
        assert "malformed request" in details
        load = raw.channels[0].stream_unary("/collectives.v1.Worker/LoadModel")
        details = expect_status(lambda: load(iter([garbage]), timeout=TIMEOUT_S), INVALID)
        assert "malformed request" in details
        # A well-formed request still works on the same server.
        cluster = coordinator.unary_unary(
            "/collectives.v1.Coordinator/GetCluster",
            request_serializer=coordinator_pb2.GetClusterRequest.SerializeToString,
            response_deserializer=coordinator_pb2.Cluster.FromString,
        )(coordinator_pb2.GetClusterRequest(), timeout=TIMEOUT_S)
        assert len([w for w in cluster.workers if w.rank >= 0]) == 2
    after.check()
