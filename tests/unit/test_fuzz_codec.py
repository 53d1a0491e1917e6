"""Property tests of the wire codec (hypothesis).

* Any supported dtype and shape (0-dim, empty, non-contiguous views) survives
  ``encode_tensor_stream`` → ``decode_part`` → ``TensorAssembler`` bit for bit,
  whatever the chunk size; NaNs, infinities and negative zeros included.
* ``decode_part`` on arbitrary bytes, and ``check_header``/``TensorAssembler``
  on arbitrary header fields, raise nothing but ``collectives.InvalidArgument``.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives import InvalidArgument
from collectives.v1 import tensor_pb2
from collectives.wire import codec
from collectives.wire.dtypes import SUPPORTED_DTYPES

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order, compared bitwise (NaN == NaN here)."""
    t = t.resolve_conj().resolve_neg()
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # fresh C-order strides
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(SUPPORTED_DTYPES))
    shape = draw(shapes)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Random bit patterns: every NaN payload, inf, -0.0, denormal, any bool byte 0/1.
    if dtype == torch.bool:
        n = math.prod(shape)
        base = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    else:
        raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
        base = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else (
            torch.empty(0, dtype=dtype))  # fmt: skip
    t = base.reshape(shape)
    # Non-contiguous views of the same data.
    view = draw(st.sampled_from(["plain", "transpose", "stride", "slice", "expand", "conj"]))
    if view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif view == "stride" and t.dim() >= 1:
        t = t[..., ::2]
    elif view == "slice" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]
    elif view == "expand" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    elif view == "conj" and t.is_complex():
        t = t.conj()
    return t


def _round_trip(name: str, t: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    frames = list(codec.encode_tensor_stream(name, t, chunk_bytes=chunk_bytes))
    kind, header = codec.decode_part(frames[0])
    assert kind == "header"
    assembler = codec.TensorAssembler(header)
    for frame in frames[1:]:
        kind, chunk = codec.decode_part(frame)
        assert kind == "chunk"
        assert len(chunk) <= chunk_bytes
        assembler.add(chunk)
    assert assembler.name == name
    return assembler.finish()


@FUZZ
@given(t=tensors(), chunk_bytes=st.integers(1, 4096))
def test_round_trip_is_bit_exact(t: torch.Tensor, chunk_bytes: int) -> None:
    out = _round_trip("fuzz/t", t, chunk_bytes)
    assert out.dtype == t.dtype
    assert tuple(out.shape) == tuple(t.shape)
    assert out.is_contiguous()
    assert _raw(out) == _raw(t)


@FUZZ
@given(t=tensors())
def test_proto_round_trip_is_bit_exact(t: torch.Tensor) -> None:
    msg = codec.tensor_to_proto(t)
    again = tensor_pb2.Tensor.FromString(msg.SerializeToString())
    out = codec.tensor_from_proto(again)
    assert (out.dtype, tuple(out.shape)) == (t.dtype, tuple(t.shape))
    assert _raw(out) == _raw(t)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)], ids=["0dim", "empty", "empty3d"])
def test_edge_shapes_every_dtype(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = torch.zeros(shape, dtype=dtype)
    out = _round_trip("edge", t, 7)
    assert (out.dtype, tuple(out.shape)) == (dtype, shape)
    assert _raw(out) == _raw(t)


def test_nan_payloads_survive() -> None:
    bits = torch.tensor([0x7FC00001, 0xFFC00000, 0x7F800001, 0x80000000], dtype=torch.int64)
    t = bits.to(torch.int32).view(torch.float32)
    assert _raw(_round_trip("nan", t, 3)) == _raw(t)


@FUZZ
@given(data=st.binary(max_size=256))
def test_decode_part_raises_only_invalid_argument(data: bytes) -> None:
    try:
        kind, _value = codec.decode_part(data)
    except InvalidArgument:
        return
    assert kind in ("header", "chunk", "empty")


@FUZZ
@given(
    tag=st.sampled_from([b"\x0a", b"\x12", b"\x08", b"\x1a", b"\x0d", b"\x09"]),
    length=st.integers(0, 1 << 62),
    body=st.binary(max_size=64),
)
def test_decode_part_framed_garbage(tag: bytes, length: int, body: bytes) -> None:
    """Plausible framing with lying lengths and garbage headers."""
    with contextlib.suppress(InvalidArgument):
        codec.decode_part(tag + codec._varint(length) + body)


int64s = st.integers(-(1 << 63), (1 << 63) - 1)


@FUZZ
@given(
    name=st.text(max_size=300),
    dtype=st.integers(-(1 << 31), (1 << 31) - 1),
    shape=st.lists(
        st.one_of(st.integers(-3, 8), int64s, st.sampled_from([1 << 20, 1 << 31, 1 << 40])),
        max_size=70,
    ),
    nbytes=st.one_of(st.integers(-8, 4096), int64s),
)
def test_check_header_and_assembler_raise_only_invalid_argument(name, dtype, shape, nbytes):
    header = tensor_pb2.TensorHeader(name=name, dtype=dtype, shape=shape, nbytes=nbytes)
    try:
        meta = codec.check_header(header)
    except InvalidArgument:
        return
    assert meta.nbytes == nbytes and meta.nbytes <= codec.MAX_TENSOR_BYTES
    if meta.nbytes > 1 << 20:  # valid but large: do not allocate it in a unit test
        return
    assembler = codec.TensorAssembler(header)
    try:
        assembler.add(b"\x00" * (nbytes + 1))
    except InvalidArgument:
        pass
    else:  # pragma: no cover - over-long chunks must be refused
        raise AssertionError("a chunk longer than declared was accepted")
    with pytest.raises(InvalidArgument) if nbytes else contextlib.nullcontext():
        assembler.finish()


@FUZZ
@given(chunks=st.lists(st.integers(0, 64), max_size=6), declared=st.integers(0, 128))
def test_assembler_chunk_streams(chunks: list[int], declared: int) -> None:
    """Any split of too few, exact or too many bytes: finish or InvalidArgument."""
    header = tensor_pb2.TensorHeader(name="a", dtype=tensor_pb2.DTYPE_UINT8, shape=[declared],
                                     nbytes=declared)  # fmt: skip
    assembler = codec.TensorAssembler(header)
    sent = 0
    try:
        for n in chunks:
            assembler.add(bytes(range(n)))
            sent += n
        out = assembler.finish()
    except InvalidArgument:
        assert sum(chunks) != declared
        return
    assert sent == declared and out.numel() == declared


def test_a_stream_of_named_tensors_assembles_by_name() -> None:
    gen = torch.Generator().manual_seed(7)
    sent = {
        "layer.weight": torch.randn(5, 3, generator=gen),
        "layer.bias": torch.randn(3, generator=gen).to(torch.float64),
        "steps": torch.randint(0, 1 << 40, (2,), generator=gen),
        "empty": torch.empty(0, 4),
    }
    parts = [p for name, t in sent.items() for p in codec.encode_tensor_stream(name, t, 16)]
    received = codec.assemble_named_tensors(iter(parts), "LoadStateDict")
    assert list(received) == list(sent)
    for name, t in sent.items():
        assert received[name].dtype == t.dtype and torch.equal(received[name], t)
    # A chunk first, and a stream cut inside a tensor, are refused by name.
    with pytest.raises(InvalidArgument, match="LoadStateDict stream must start with a header"):
        codec.assemble_named_tensors(iter(parts[1:]), "LoadStateDict")
    with pytest.raises(InvalidArgument, match="stream ended after 16 of 60 declared bytes"):
        codec.assemble_named_tensors(iter(parts[:2]), "LoadStateDict")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128], ids=str)
@pytest.mark.parametrize("delta", [-1, 0, 1], ids=["under", "at", "over"])
def test_proto_round_trip_around_the_small_tensor_bound(dtype: torch.dtype, delta: int) -> None:
    """Both decode paths (a bytearray up to SMALL_TENSOR_BYTES, a buffer beyond) give a
    tensor of its own: bit exact, writable, and independent of the message."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = codec.SMALL_TENSOR_BYTES // itemsize + delta
    t = torch.randn(numel, dtype=torch.float64).to(dtype)
    msg = tensor_pb2.Tensor.FromString(codec.tensor_to_proto(t).SerializeToString())
    out = codec.tensor_from_proto(msg)
    assert (out.dtype, tuple(out.shape)) == (dtype, (numel,))
    assert _raw(out) == _raw(t)
    out.zero_()
    assert _raw(codec.tensor_from_proto(msg)) == _raw(t)
