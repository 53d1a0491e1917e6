"""Raw gRPC access to a real local cluster, for the bad-input tests.

Hand-made data-plane frames (``header_frame``, ``chunk_frame``,
``tensor_frames``), an :class:`Env` of raw channels to the coordinator and to
each worker, a few request helpers, and :func:`assert_healthy`, the check run
after every bad request. The ``env`` fixture is in this directory's conftest.py.
"""

from __future__ import annotations

import os
import threading
import uuid

import grpc
import torch

from collectives.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    tensor_pb2,
    worker_pb2,
    worker_pb2_grpc,
)

NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
TIMEOUT_S = 30.0
F32 = tensor_pb2.DTYPE_FLOAT32
I64 = tensor_pb2.DTYPE_INT64


# ----------------------------------------------------------------- raw framing
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


def chunk_frame(data: bytes) -> bytes:
    return b"\x12" + _varint(len(data)) + data


def tensor_frames(name: str, t: torch.Tensor) -> list[bytes]:
    t = t.contiguous()
    wire = {torch.float32: F32, torch.int64: I64, torch.complex64: tensor_pb2.DTYPE_COMPLEX64}
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    step = 1 << 20
    chunks = [chunk_frame(data[i : i + step]) for i in range(0, len(data), step)]
    return [header_frame(name, wire[t.dtype], list(t.shape), len(data)), *chunks]


class Env:
    """Raw channels to the coordinator and to each worker, in rank order."""

    def __init__(self, coordinator: str) -> None:
        self.coordinator_channel = grpc.insecure_channel(coordinator)
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(self.coordinator_channel)
        cluster = self.coordinator.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=10)
        members = sorted((w for w in cluster.workers if w.rank >= 0), key=lambda w: w.rank)
        self.generation = cluster.generation
        self.membership_digest = cluster.membership_digest
        self.world_size = len(members)
        self.channels = [grpc.insecure_channel(w.address) for w in members]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.pids = [s.GetState(worker_pb2.GetStateRequest(), timeout=10).pid for s in self.stubs]
        self.leader = self.stubs[0]
        self.prefix = f"bad{uuid.uuid4().hex[:8]}"
        self.model = f"{self.prefix}/mlp"
        self._lock = threading.Lock()
        self._count = 0

    def name(self, tag: str = "x") -> str:
        with self._lock:
            self._count += 1
            return f"{self.prefix}/{tag}{self._count}"

    def put_raw(self, frames: list[bytes], rank: int = 0, timeout: float = TIMEOUT_S):
        call = self.channels[rank].stream_unary(
            "/collectives.v1.Worker/PutTensor",
            request_serializer=None,
            response_deserializer=worker_pb2.PutTensorResponse.FromString,
        )
        return call(iter(frames), timeout=timeout)

    def get_raw(self, name: str, rank: int = 0) -> torch.Tensor:
        call = self.channels[rank].unary_stream(
            "/collectives.v1.Worker/GetTensor",
            request_serializer=worker_pb2.GetTensorRequest.SerializeToString,
            response_deserializer=None,
        )
        parts = list(call(worker_pb2.GetTensorRequest(name=name), timeout=TIMEOUT_S))
        header = tensor_pb2.TensorHeader.FromString(_payload(parts[0], 0x0A))
        data = b"".join(_payload(p, 0x12) for p in parts[1:])
        dtype = {F32: torch.float32, I64: torch.int64}[header.dtype]
        out = (
            torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        )
        return out.reshape(list(header.shape))

    def put(self, name: str, t: torch.Tensor, rank: int = 0) -> None:
        self.put_raw(tensor_frames(name, t), rank)

    def put_all(self, name: str, tensors: list[torch.Tensor]) -> None:
        for rank, t in enumerate(tensors):
            self.put(name, t, rank)

    def close(self) -> None:
        for c in (*self.channels, self.coordinator_channel):
            c.close()


def _payload(frame: bytes, tag: int) -> bytes:
    assert frame[0] == tag
    pos, length, shift = 1, 0, 0
    while True:
        byte = frame[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return frame[pos : pos + length]


# ------------------------------------------------------------ collective helpers
def opts(**kw) -> worker_pb2.OpOptions:
    return worker_pb2.OpOptions(timeout_s=TIMEOUT_S, **kw)


def stored(e: Env, t: torch.Tensor, tag: str = "x") -> str:
    """A tensor of the same dtype and shape on every rank; returns its name."""
    name = e.name(tag)
    e.put_all(name, [t] * e.world_size)
    return name


def all_reduce(e: Env, name: str, op: int = 0, stub=None, **options):
    stub = stub or e.leader
    request = worker_pb2.AllReduceRequest(options=opts(**options), name=name, op=op)
    return stub.AllReduce(request, timeout=TIMEOUT_S)


# ---------------------------------------------------------------- health check
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_healthy(e: Env) -> None:
    """Every worker process lives, and a valid put/get and all_reduce succeed."""
    dead = [pid for pid in e.pids if not _alive(pid)]
    assert not dead, f"worker process(es) {dead} died"
    for stub in (*e.stubs,):
        stub.GetState(worker_pb2.GetStateRequest(), timeout=10)
    parts = [torch.randn(4, 3) for _ in range(e.world_size)]
    name = e.name("ok")
    e.put_all(name, parts)
    for rank, part in enumerate(parts):
        assert torch.equal(e.get_raw(name, rank), part)
    response = all_reduce(e, name)
    assert response.generation == e.generation
    expected = torch.stack(parts).sum(0)
    for rank in range(e.world_size):
        torch.testing.assert_close(e.get_raw(name, rank), expected)
        e.stubs[rank].DeleteTensor(worker_pb2.DeleteTensorRequest(name=name), timeout=10)
