"""The tensor wire codec: raw bytes in, raw bytes out, no protobuf copy.

Data-plane messages (``PutTensorRequest``, ``GetTensorResponse``) are a oneof of
``TensorHeader header = 1`` and ``bytes chunk = 2``. On the wire they are plain
protobuf, so any gRPC client can speak them; in Python we frame and parse them
by hand (tag, varint length, payload) because a protobuf ``bytes`` field costs
an extra copy and several times the time of the raw bytes. Chunks are parsed into
memoryviews of the received message and copied once, straight into a buffer
preallocated from the header, so a tensor of N bytes needs N bytes of RAM on
the receiving side plus one chunk in flight.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from collectives.errors import InvalidArgument, ResourceExhausted
from collectives.v1 import tensor_pb2
from collectives.wire.dtypes import SUPPORTED_DTYPES, from_wire, to_wire
from collectives.wire.limits import MAX_MESSAGE_BYTES
from collectives.wire.memory import empty_bytes

__all__ = [
    "CHUNK_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_TENSOR_BYTES",
    "frame_header",
    "frame_chunk",
    "encode_tensor_stream",
    "decode_part",
    "TensorAssembler",
    "assemble_named_tensors",
    "tensor_memoryview",
    "make_header",
    "check_header",
    "CheckedHeader",
    "check_shape",
    "allocate_bytes",
    "MAX_DIMS",
    "MAX_ELEMENTS",
    "tensor_to_proto",
    "write_tensor",
    "tensor_from_proto",
    "tensor_from_bytes",
    "wire_tensor",
    "typed",
    "check_out",
    "OutMismatch",
]

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch builds in use
    raise ImportError("collectives' wire format is little-endian; this host is big-endian")

# A chunk plus its framing stays under gRPC's default 4 MiB message limit, so
# clients with default settings (grpcurl, other languages) can stream too.
CHUNK_BYTES = 4 * 1024 * 1024 - 4096
# Tensors up to this size are decoded onto a bytearray (see tensor_from_bytes).
SMALL_TENSOR_BYTES = 1 << 20
# What our own channels and servers accept (MAX_MESSAGE_BYTES, from .limits):
# one chunk, framing, and a header.
# A sanity bound for declared sizes (1 TiB): larger headers are rejected before allocating.
MAX_TENSOR_BYTES = 1 << 40
MAX_DIMS = 64
# At most 2^48 elements, counted as if no dim were 0: a [0, 2^62, 2^62] tensor holds
# no bytes, yet every op that multiplies its dims (an all_gather's output, a
# reshape, torch's own numel checks) overflows on it. Absurd dims are refused at the put.
MAX_ELEMENTS = 1 << 48

_HEADER_TAG = b"\x0a"  # field 1, wire type 2 (length-delimited)
_CHUNK_TAG = b"\x12"  # field 2, wire type 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise InvalidArgument("malformed message: truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidArgument("malformed message: varint longer than 10 bytes")


def frame_header(header: tensor_pb2.TensorHeader) -> bytes:
    body = header.SerializeToString()
    return _HEADER_TAG + _varint(len(body)) + body


def frame_chunk(chunk: memoryview | bytes) -> bytes:
    return b"".join((_CHUNK_TAG, _varint(len(chunk)), chunk))


def decode_part(data: bytes) -> tuple[str, tensor_pb2.TensorHeader | memoryview | None]:
    """Parses one data-plane message into ``("header", TensorHeader)``,
    ``("chunk", memoryview)`` or ``("empty", None)``.

    Accepts any valid protobuf encoding (unknown fields skipped; for a oneof,
    the last member present wins) and raises :class:`InvalidArgument` on
    malformed input rather than anything else.
    """
    buf = memoryview(data)
    pos = 0
    kind, value = "empty", None
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise InvalidArgument("malformed message: field length runs past the end")
            payload = buf[pos : pos + length]
            pos += length
            if field == 1:
                header = tensor_pb2.TensorHeader()
                try:
                    header.ParseFromString(payload.tobytes())
                except Exception as exc:  # protobuf raises DecodeError
                    raise InvalidArgument(f"malformed tensor header: {exc}") from None
                kind, value = "header", header
            elif field == 2:
                kind, value = "chunk", payload
        elif wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise InvalidArgument(f"malformed message: unsupported wire type {wire_type}")
        if pos > len(buf):
            raise InvalidArgument("malformed message: truncated field")
    return kind, value


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (keep ``t`` alive while used)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_memoryview needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def make_header(name: str, t: torch.Tensor) -> tensor_pb2.TensorHeader:
    return tensor_pb2.TensorHeader(
        name=name,
        dtype=to_wire(t.dtype),
        shape=list(t.shape),
        nbytes=t.numel() * t.element_size(),
    )


def wire_tensor(t: torch.Tensor) -> torch.Tensor:
    """CPU, C-contiguous, non-conjugated, non-negated: what the bytes must describe."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.resolve_conj().resolve_neg().contiguous()


class Advance(Protocol):
    """Counts bytes moved (a progress bar; see ``collectives._progress``)."""

    def advance(self, n: int) -> None: ...


def encode_tensor_stream(
    name: str, t: torch.Tensor, chunk_bytes: int = CHUNK_BYTES, progress: Advance | None = None
) -> Iterator[bytes]:
    """Yields the framed messages of one tensor: header, then chunks of payload.

    ``progress`` is advanced by each chunk's payload bytes as it is handed over.
    """
    t = wire_tensor(t)
    yield frame_header(make_header(name, t))
    view = tensor_memoryview(t)
    for start in range(0, len(view), chunk_bytes):
        chunk = view[start : start + chunk_bytes]
        yield frame_chunk(chunk)
        if progress is not None:
            progress.advance(len(chunk))


@dataclass(frozen=True)
class CheckedHeader:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def check_shape(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """A shape every op can handle: at most :data:`MAX_DIMS` dims, each >= 0, and the
    product of the dims (zeros counted as ones) at most :data:`MAX_ELEMENTS`.

    Raises :class:`InvalidArgument`. Counting zeros as ones is what refuses
    ``[0, 2**62, 2**62]``: zero bytes, but no op on it can compute an output shape.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(f"tensor has {len(shape)} dimensions; at most {MAX_DIMS} allowed")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"tensor shape {_short(shape)} has a negative dimension")
    product = 1
    for d in shape:
        product *= max(d, 1)
        if product > MAX_ELEMENTS:
            raise InvalidArgument(
                f"tensor shape {_short(shape)} is absurd: its dims multiply to more than "
                f"2^48; the limit is {MAX_ELEMENTS} elements (0 dims counted as 1)"
            )
    return shape


def _short(shape: tuple[int, ...]) -> str:
    text = str(list(shape))
    return text if len(text) <= 200 else text[:200] + "...]"


def check_header(header: tensor_pb2.TensorHeader) -> CheckedHeader:
    """Validates dtype, shape and size of a header; raises :class:`InvalidArgument`."""
    return _checked(header.name, header.dtype, header.shape, header.nbytes)


def _checked(name: str, wire_dtype: int, wire_shape: Sequence[int], nbytes: int) -> CheckedHeader:
    dtype = from_wire(wire_dtype)
    shape = check_shape(wire_shape)
    numel = math.prod(shape)
    expected = numel * dtype.itemsize
    if expected > MAX_TENSOR_BYTES:
        raise InvalidArgument(
            f"tensor shape {_short(shape)} of {dtype} would need {expected} bytes; "
            f"the limit is {MAX_TENSOR_BYTES}"
        )
    if nbytes != expected:
        raise InvalidArgument(
            f"header declares {nbytes} bytes but shape {_short(shape)} of {dtype} needs {expected}"
        )
    return CheckedHeader(name, dtype, shape, expected)


def _physical_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def allocate_bytes(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """A receive buffer of ``nbytes`` (see :func:`collectives.wire.memory.empty_bytes`), or a
    clear error instead of a ``MemoryError``/allocator ``RuntimeError``.

    Over :data:`MAX_TENSOR_BYTES` (or negative) is :class:`InvalidArgument`; more than
    this host's physical memory, or an allocation the OS refuses, is
    :class:`ResourceExhausted` (a store quota, where one is set, is checked before this).
    """
    if nbytes < 0 or nbytes > MAX_TENSOR_BYTES:
        raise InvalidArgument(
            f"a tensor of {nbytes} bytes is out of range (at most {MAX_TENSOR_BYTES})"
        )
    physical = _physical_bytes()
    if physical is not None and nbytes > physical:
        raise ResourceExhausted(
            f"a tensor of {nbytes} bytes is larger than this host's memory ({physical} bytes)"
        )
    try:
        if pin_memory:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return empty_bytes(nbytes)
    except (MemoryError, RuntimeError):
        raise ResourceExhausted(
            f"cannot allocate {nbytes} bytes for this tensor on this host right now"
        ) from None


def typed(buffer: torch.Tensor, meta: CheckedHeader) -> torch.Tensor:
    """The tensor ``meta`` describes on ``buffer``'s memory (``meta.nbytes`` uint8):
    a tensor of its own on that storage when ``buffer`` is all of it (so that its
    owner can tell that nothing else holds the memory), else a view of ``buffer``."""
    storage = buffer.untyped_storage()
    if buffer.storage_offset() != 0 or storage.nbytes() != meta.nbytes:
        return buffer.view(meta.dtype).reshape(meta.shape)
    return torch.empty(0, dtype=meta.dtype, device=buffer.device).set_(storage, 0, meta.shape)


class OutMismatch(InvalidArgument):
    """A get's ``out=`` tensor cannot hold the tensor the worker holds."""


def check_out(out: torch.Tensor, meta: CheckedHeader | None = None) -> None:
    """Raises :class:`OutMismatch` unless ``out`` can receive ``meta``'s bytes in place: a
    contiguous CPU tensor that does not require grad (checked before any call, with
    ``meta`` None) of the same dtype and shape (checked once the header is known)."""
    if out.device.type != "cpu" or not out.is_contiguous():
        layout = "contiguous" if out.is_contiguous() else "strided"
        raise OutMismatch(f"out must be a contiguous CPU tensor, not a {layout} {out.device} one")
    if out.requires_grad:
        raise OutMismatch("out must not require grad (it is written in place)")
    if meta is not None and (out.dtype != meta.dtype or tuple(out.shape) != meta.shape):
        raise OutMismatch(
            f"out is {out.dtype} {list(out.shape)}, but {meta.name!r} is {meta.dtype} "
            f"{list(meta.shape)}"
        )


class TensorAssembler:
    """Receives one tensor's chunks into a single preallocated buffer: ``out`` (checked
    against the header), else ``alloc(nbytes)``, a uint8 tensor of that size
    (:func:`allocate_bytes` unless given)."""

    def __init__(
        self,
        header: tensor_pb2.TensorHeader,
        alloc: Callable[[int], torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        self.meta = check_header(header)
        if out is not None:
            check_out(out, self.meta)
        self._out = out
        self._buffer = out if out is not None else (alloc or allocate_bytes)(self.meta.nbytes)
        self._view = tensor_memoryview(self._buffer)
        self._filled = 0

    @property
    def name(self) -> str:
        return self.meta.name

    def add(self, chunk: memoryview | bytes) -> None:
        end = self._filled + len(chunk)
        if end > self.meta.nbytes:
            raise InvalidArgument(
                f"tensor {self.meta.name!r}: chunks exceed the declared {self.meta.nbytes} bytes"
            )
        if end == self._filled:  # an empty chunk (the view of a 0-byte buffer is read-only)
            return
        self._view[self._filled : end] = chunk
        self._filled = end

    def finish(self) -> torch.Tensor:
        if self._filled != self.meta.nbytes:
            raise InvalidArgument(
                f"tensor {self.meta.name!r}: stream ended after {self._filled} of "
                f"{self.meta.nbytes} declared bytes"
            )
        tensor = self._out if self._out is not None else typed(self._buffer, self.meta)
        self._buffer = self._view = self._out = None  # the tensor alone holds the memory now
        return tensor


def assemble_named_tensors(parts: Iterable[bytes], stream: str) -> dict[str, torch.Tensor]:
    """The tensors of a stream of raw-framed parts (header, chunks, header, ...), by name.

    ``stream`` names the stream in the error a chunk before any header raises
    (:class:`InvalidArgument`, as every malformed part does). What was received
    is dropped with the error: the caller's frame holds none of it.
    """
    received: dict[str, torch.Tensor] = {}
    assembler: TensorAssembler | None = None
    try:
        for raw in parts:
            kind, value = decode_part(raw)
            if kind == "header":
                if assembler is not None:
                    received[assembler.name] = assembler.finish()
                assembler = TensorAssembler(value)
            elif kind == "chunk":
                if assembler is None:
                    raise InvalidArgument(f"{stream} stream must start with a header")
                assembler.add(value)
        if assembler is not None:
            received[assembler.name] = assembler.finish()
    except BaseException:
        received.clear()
        assembler = None
        raise
    return received


def tensor_to_proto(t: torch.Tensor) -> tensor_pb2.Tensor:
    msg = tensor_pb2.Tensor()
    write_tensor(msg, t)
    return msg


def write_tensor(msg: tensor_pb2.Tensor, t: torch.Tensor) -> None:
    """Writes ``t`` into ``msg`` (a field of a message being built) in place."""
    t = wire_tensor(t)
    msg.dtype = to_wire(t.dtype)
    msg.shape.extend(t.shape)
    msg.data = t.numpy().tobytes() if t.dtype in _NUMPY_DTYPES else tensor_memoryview(t).tobytes()


# The wire dtypes numpy has (a contiguous CPU tensor of one is copied out by numpy).
_NUMPY_DTYPES = frozenset(SUPPORTED_DTYPES) - {torch.bfloat16}


def tensor_from_bytes(data: bytes | memoryview, meta: CheckedHeader) -> torch.Tensor:
    """A new tensor of ``meta``'s dtype and shape holding a copy of ``data``.

    Up to :data:`SMALL_TENSOR_BYTES` the copy is a ``bytearray`` the tensor is made
    on, the cheapest way for the small tensors of every forward and small op;
    larger ones get a buffer of :func:`allocate_bytes` (huge pages, and a clear
    error when the host cannot hold it)."""
    if len(data) != meta.nbytes:
        raise InvalidArgument(f"{len(data)} bytes for a tensor of {meta.nbytes} bytes")
    if 0 < meta.nbytes <= SMALL_TENSOR_BYTES:
        return torch.frombuffer(bytearray(data), dtype=meta.dtype).view(meta.shape)
    buffer = allocate_bytes(meta.nbytes)
    if meta.nbytes:
        tensor_memoryview(buffer)[:] = data
    return typed(buffer, meta)


def tensor_from_proto(msg: tensor_pb2.Tensor) -> torch.Tensor:
    """A new tensor holding a copy of ``msg``'s bytes, its header checked as a
    streamed tensor's is (:func:`check_header`)."""
    return tensor_from_bytes(msg.data, _checked("tensor", msg.dtype, msg.shape, len(msg.data)))
