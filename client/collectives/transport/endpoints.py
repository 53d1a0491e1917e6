"""Worker endpoints and the data-plane calls: put and get over a stream, bulk or shm.

Every call made here has a deadline, and every ``grpc.RpcError`` leaves this
module converted by :func:`collectives.errors.from_rpc_error`, so its callers
deal in :class:`~collectives.errors.CollectiveError` only. (Other SDK modules
that make their own calls, e.g. ``_model_transport``, ``_membership`` and
``bulk``, convert their errors the same way.)

The data plane bypasses the generated protobuf classes: ``PutTensor`` is fed
the hand-framed bytes of :func:`collectives.wire.codec.encode_tensor_stream` (a
multi-callable with ``request_serializer=None`` passes bytes through), and
``GetTensor`` responses arrive as bytes that :func:`collectives.wire.codec.decode_part`
splits into a header and memoryview chunks. The messages on the wire are still
the ``PutTensorRequest``/``GetTensorResponse`` protobufs of ``worker.proto``.
Whether a put or get takes shared memory, the worker's bulk port or that gRPC
stream is decided in one place, :func:`collectives.transport.roads.choose_path`.
"""

from __future__ import annotations

import functools
import os
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import torch
from google.protobuf import message_factory
from google.protobuf.message import Message

from collectives._deadlines import timeout_left
from collectives._progress import NO_PROGRESS, Progress
from collectives.errors import (
    CollectiveError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    channel_was_closed,
    closed_handle,
    error_for_code,
)
from collectives.errors import from_rpc_error as _from_rpc_error
from collectives.transport import bulk, lanes
from collectives.transport.calls import Call, Job
from collectives.transport.channels import (
    CHANNEL_OPTIONS,
    call_unary,
    open_channel,
    wait_channel_ready,
)
from collectives.transport.channels import deadline_s as _deadline_s
from collectives.transport.roads import DataPath, Route, choose_path
from collectives.transport.shm import Segment, SegmentPool
from collectives.v1 import tensor_pb2, worker_pb2, worker_pb2_grpc
from collectives.wire import codec, raw_tls, shm
from collectives.wire.security import PLAINTEXT, ChannelSecurity

__all__ = [
    "CHANNEL_OPTIONS",
    "ChannelPool",
    "WorkerEndpoint",
    "WorkerMethod",
    "call_unary",
    "get_tensor",
    "is_retryable_read",
    "open_channel",
    "put_tensor",
    "put_tensor_shm",
    "get_tensor_shm",
    "wait_channel_ready",
]

R = TypeVar("R")

_PUT_TENSOR = "/collectives.v1.Worker/PutTensor"
_GET_TENSOR = "/collectives.v1.Worker/GetTensor"


@dataclass(frozen=True)
class WorkerEndpoint:
    """A worker's channel and the callables the SDK uses on it."""

    address: str
    channel: grpc.Channel
    stub: worker_pb2_grpc.WorkerStub
    # Raw-bytes data-plane callables (no protobuf on the client side).
    put_raw: grpc.StreamUnaryMultiCallable
    get_raw: grpc.UnaryStreamMultiCallable
    # The worker's bulk port, asked on first use (see collectives.transport.bulk).
    bulk: bulk.BulkPort = field(default_factory=bulk.BulkPort)
    # Kept call lanes on that port for small calls (see collectives.transport.lanes).
    lanes: lanes.CallLanes = field(default_factory=lanes.CallLanes)

    @classmethod
    def open(
        cls, address: str, security: ChannelSecurity = PLAINTEXT, client_name: str | None = None
    ) -> WorkerEndpoint:
        channel = open_channel(address, security, client_name)
        return cls(
            address=address,
            channel=channel,
            stub=worker_pb2_grpc.WorkerStub(channel),
            put_raw=channel.stream_unary(
                _PUT_TENSOR,
                request_serializer=None,
                response_deserializer=worker_pb2.PutTensorResponse.FromString,
            ),
            get_raw=channel.unary_stream(
                _GET_TENSOR,
                request_serializer=worker_pb2.GetTensorRequest.SerializeToString,
                response_deserializer=None,
            ),
            # Raw TCP (bulk transfers, call lanes) through TLS when this client is TLS.
            bulk=bulk.BulkPort(_raw_tls(security)),
        )

    def unary(self, method: str) -> WorkerMethod:
        """The Worker RPC ``method`` (``"Forward"``, ``"AllReduce"``...) on this worker."""
        return WorkerMethod(self, method)


class WorkerMethod:
    """A Worker RPC on one worker, shaped like a gRPC multi-callable: calling it
    waits for the answer; :meth:`future` sends it and returns the started
    :class:`~collectives.transport.calls.Call`.

    The road is chosen here alone: a call lane when the worker's lanes carry the
    method and the request fits one (:mod:`collectives.transport.lanes`; over TLS for a
    TLS client), else a gRPC call. The answer and the errors are the same either way:
    every failure is a :class:`~collectives.errors.CollectiveError`.
    """

    __slots__ = ("_endpoint", "_name")

    def __init__(self, endpoint: WorkerEndpoint, name: str) -> None:
        self._endpoint = endpoint
        self._name = name

    def __call__(self, request: Message, timeout: float, what: str) -> Any:
        """The call's response, waited for.

        Raises:
            CollectiveError: the call failed (subclass by status code).
        """
        sent = self._on_lane(request, timeout, what)
        if sent is not None:
            return sent.result()
        return call_unary(getattr(self._endpoint.stub, self._name), request, timeout, what)

    def future(self, request: Message, timeout: float, what: str) -> Call[Any]:
        """The call, started: on a lane it is sent now; as a gRPC call it is a
        :class:`~collectives.transport.calls.Job` that ``Session.fan_out`` runs on its pool
        (or that runs when awaited). ``result()`` waits for the response.

        Raises:
            CollectiveError: a lane call could not be sent (its deadline passed, or
                the cluster was closed); any other failure is ``result()``'s.
        """
        sent = self._on_lane(request, timeout, what)
        if sent is not None:
            return sent
        # A gRPC call, made by the thread that runs the job (a gRPC future would
        # start a thread of gRPC's on an idle channel, dearer than a small call).
        method = getattr(self._endpoint.stub, self._name)
        deadline = time.monotonic() + timeout
        return Job(lambda: call_unary(method, request, deadline - time.monotonic(), what))

    def _on_lane(self, request: Message, timeout: float, what: str) -> Call[Any] | None:
        """The call, sent on a lane; None when no lane carries it (nothing sent)."""
        try:
            pending = self._endpoint.lanes.send(
                self._endpoint, self._name, request.SerializeToString(), _deadline_s(timeout, what)
            )
        except grpc.RpcError as err:
            raise _from_rpc_error(err, what) from None
        if pending is None:
            return None
        return _LaneCall(pending, _response_class(self._name).FromString, what)


class _LaneCall:
    __slots__ = ("_parse", "_pending", "_what")

    def __init__(
        self, pending: lanes.PendingCall, parse: Callable[[bytes], Any], what: str
    ) -> None:
        self._pending = pending
        self._parse = parse
        self._what = what

    def result(self) -> Any:
        try:
            return self._parse(self._pending.result())
        except grpc.RpcError as err:
            raise _from_rpc_error(err, self._what) from None


@functools.lru_cache(maxsize=8)
def _raw_tls(security: ChannelSecurity) -> ssl.SSLContext | None:
    """The TLS context of raw-TCP connections, one per client settings (loading a
    client certificate costs file writes)."""
    return raw_tls.client_context(security)


@functools.cache
def _response_class(method: str) -> type[Message]:
    """The response message class of the Worker RPC ``method``."""
    descriptor = worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name[method]
    return message_factory.GetMessageClass(descriptor.output_type)


class ChannelPool:
    """One channel per worker address, created on first use, closed together."""

    def __init__(
        self, security: ChannelSecurity = PLAINTEXT, client_name: str | None = None
    ) -> None:
        self._security = security
        self._client_name = client_name
        self._lock = threading.Lock()
        self._endpoints: dict[str, WorkerEndpoint] = {}
        self._closed = False

    def endpoint(self, address: str) -> WorkerEndpoint:
        """The cached endpoint for ``address``.

        Raises:
            Unavailable: the pool is closed (the cluster was closed).
        """
        with self._lock:
            if self._closed:
                raise Unavailable("the cluster connection is closed")
            endpoint = self._endpoints.get(address)
            if endpoint is None:
                endpoint = WorkerEndpoint.open(address, self._security, self._client_name)
                self._endpoints[address] = endpoint
            return endpoint

    def close(self) -> None:
        with self._lock:
            self._closed = True
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            endpoint.lanes.close()
            endpoint.channel.close()


def put_tensor(
    endpoint: WorkerEndpoint,
    name: str,
    t: torch.Tensor,
    timeout: float,
    route: Route | None = None,
    progress: Progress = NO_PROGRESS,
) -> worker_pb2.PutTensorResponse:
    """Stores ``t`` on ``endpoint`` under ``name``: over the worker's bulk port or
    streamed in chunks of at most 4 MiB, as ``route`` (default: :func:`choose_path`
    without shared memory) says. ``progress`` counts the bytes sent (a failed
    try's bytes are taken back).

    Raises:
        CollectiveError: the worker refused the tensor or the call failed.
    """
    what = f"PutTensor {name!r} to {endpoint.address}"
    timeout = timeout_left(timeout, what)
    if route is None:
        route = choose_path(endpoint, timeout, nbytes=t.numel() * t.element_size())
    _check_not_shm(route, what)
    if route.path is DataPath.BULK:
        started = time.monotonic()
        try:
            with progress.attempt() as sent:
                counted = None if sent is NO_PROGRESS else sent
                return bulk.put_tensor_bulk(
                    endpoint, route.bulk_port, name, codec.wire_tensor(t), timeout, counted
                )
        except bulk.BulkUnreachable:
            endpoint.bulk.suspend()  # full or refusing: the gRPC stream carries it
            timeout -= time.monotonic() - started
    try:
        with progress.attempt() as sent:
            frames = codec.encode_tensor_stream(
                name, t, progress=None if sent is NO_PROGRESS else sent
            )
            return endpoint.put_raw(frames, timeout=_deadline_s(timeout, what))
    except grpc.RpcError as err:
        raise _from_rpc_error(err, what) from None
    except ValueError as err:
        if not channel_was_closed(err):
            raise
        raise closed_handle(what) from None


def get_tensor(
    endpoint: WorkerEndpoint,
    name: str,
    timeout: float,
    consume: bool = False,
    route: Route | None = None,
    progress: Callable[[int], Progress] | None = None,
    out: torch.Tensor | None = None,
    result_of: worker_pb2.ResultOf | None = None,
) -> torch.Tensor:
    """Downloads the tensor stored under ``name`` into one preallocated CPU buffer
    (``out`` when given, see ``Cluster.get``), through the worker's bulk port or
    streamed over gRPC as ``route`` (default: :func:`choose_path` without shared
    memory) says. ``progress(nbytes)``, called once the size is known, gives what
    counts the bytes received. ``result_of``: the op whose result this reads back
    (the worker refuses another value; see ``worker.proto``).

    Raises:
        NotFound: the worker holds no tensor under ``name``.
        CollectiveError: the call failed, or the worker sent a malformed stream.
    """
    if out is not None and consume:
        raise ValueError("get_tensor: out= with consume would lose the tensor on a mismatch")
    if route is None:
        route = choose_path(endpoint, timeout, nbytes=None)
    _check_not_shm(route, f"GetTensor {name!r} from {endpoint.address}")
    if route.path is DataPath.BULK:
        started = time.monotonic()
        try:
            return bulk.get_tensor_bulk(
                endpoint, route.bulk_port, name, timeout, consume, progress, out, result_of
            )
        except bulk.BulkUnreachable:
            endpoint.bulk.suspend()  # full or refusing: the gRPC stream carries it
            timeout -= time.monotonic() - started
        except ResourceExhausted:
            # No quota left for a ticket's copy: the stream needs none.
            timeout -= time.monotonic() - started
    what = f"GetTensor {name!r} from {endpoint.address}"
    try:
        call = endpoint.get_raw(
            worker_pb2.GetTensorRequest(name=name, consume=consume, result_of=result_of),
            timeout=_deadline_s(timeout, what),
        )
    except ValueError as err:
        if not channel_was_closed(err):
            raise
        raise closed_handle(what) from None
    assembler: codec.TensorAssembler | None = None
    received = NO_PROGRESS
    try:
        for message in call:
            kind, value = codec.decode_part(message)
            if isinstance(value, tensor_pb2.TensorHeader):
                if assembler is not None:
                    raise InvalidArgument("a second header arrived mid-stream")
                assembler = codec.TensorAssembler(value, out=out)
                if progress is not None:
                    received = progress(assembler.meta.nbytes)
            elif kind == "chunk" and value is not None:
                if assembler is None:
                    raise InvalidArgument("a chunk arrived before the header")
                assembler.add(value)
                received.advance(len(value))
        if assembler is None:
            raise InvalidArgument("the stream ended without a header")
        return assembler.finish()
    except grpc.RpcError as err:
        assembler = message = value = None  # the traceback keeps this frame, not the buffer
        raise _from_rpc_error(err, what) from None
    except codec.OutMismatch:
        call.cancel()  # the caller's out= does not fit: theirs to fix
        raise
    except InvalidArgument as err:
        # Our request was fine; the worker's answer was not. Not the caller's fault.
        call.cancel()
        assembler = message = value = None
        raise error_for_code(
            grpc.StatusCode.INTERNAL, f"{what}: malformed response stream: {err.message}"
        ) from None


def _check_not_shm(route: Route, what: str) -> None:
    if route.path is DataPath.SHM:
        raise ValueError(f"{what}: shared memory goes through put_tensor_shm/get_tensor_shm")


def put_tensor_shm(
    endpoint: WorkerEndpoint,
    name: str,
    t: torch.Tensor,
    segment: Segment,
    timeout: float,
    pool: SegmentPool | None = None,
    hand_over: bool = False,
) -> worker_pb2.PutTensorResponse:
    """Stores ``t`` (already written to ``segment``) through shared memory.

    With ``hand_over`` (a put to this worker alone) the segment is offered to
    the worker, which may keep the tensor in it (see ``SegmentPool.hand_over``);
    the request also asks which segments handed over earlier came back. A
    segment the worker did not take is the caller's again; one whose call
    failed stays handed over until a later answer says otherwise. A segment of
    a call that failed unanswered is retired (see ``Segment.retire``): a retry
    may use it, the pool never again.

    Raises:
        CollectiveError: the worker refused the tensor or the segment, or the call failed.
    """
    what = f"PutTensorShm {name!r} to {endpoint.address}"
    worker = endpoint.address
    nbytes = t.numel() * t.element_size()
    offered = hand_over and pool is not None and pool.hand_over(segment, worker, nbytes)
    request = worker_pb2.PutTensorShmRequest(
        header=codec.make_header(name, t),
        path=segment.path,
        hand_over=offered,
        lent=pool.handed_over(worker, but=segment.path) if pool is not None else (),
    )
    try:
        response = endpoint.unary("PutTensorShm")(request, timeout, what)
    except BaseException as err:
        if isinstance(err, CollectiveError) and err.code in _REFUSED_BEFORE_READING:
            if offered and pool is not None:
                pool.take_back(worker, [segment.path], current=segment)
        elif not _answered(err):
            # The worker may yet read it, or keep a tensor in it after a later
            # answer said it holds none: never pooled again (a retry still uses it).
            segment.retire()
        raise
    if pool is not None:
        taken = [] if response.adopted else [segment.path]
        pool.take_back(worker, [*taken, *response.returned], current=segment)
    return response


# What a worker answers before it touches a put's segment: it cannot hold it.
_REFUSED_BEFORE_READING = frozenset(
    {
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


def get_tensor_shm(
    endpoint: WorkerEndpoint,
    name: str,
    timeout: float,
    pool: SegmentPool,
    consume: bool = False,
    result_of: worker_pb2.ResultOf | None = None,
) -> torch.Tensor:
    """Downloads ``name`` through shared memory (``result_of``: as :func:`get_tensor`):
    the worker writes into a free
    segment of ``pool`` when one is large enough, else into a new segment that
    the pool takes over. The tensor returned lies in that segment (no copy),
    which goes back to the pool when the tensor is freed.

    Raises:
        NotFound: the worker holds no tensor under ``name``.
        CollectiveError: the call failed, or the worker's segment was unusable.
    """
    what = f"GetTensorShm {name!r} from {endpoint.address}"
    lease = pool.acquire()
    try:
        request = worker_pb2.GetTensorShmRequest(
            name=name, consume=consume, path=lease.path if lease else "", result_of=result_of
        )
        try:
            response = endpoint.unary("GetTensorShm")(request, timeout, what)
        except BaseException as err:
            if lease is not None and not _answered(err):
                pool.discard(lease)  # the worker may still write the tensor into it
                lease = None
            raise
        try:
            meta = codec.check_header(response.header)
            if lease is not None and response.path == lease.path:
                if lease.size < response.offset + meta.nbytes:
                    raise InvalidArgument("the segment is smaller than the tensor")
                lent, lease = lease, None  # the tensor holds it now
                return lent.lend(pool, response.offset, meta)
            if not shm.is_worker_segment(response.path):  # not ours to keep: copy out
                fd = shm.open_checked(response.path, response.offset, meta.nbytes)
                try:
                    return shm.read_segment(fd, response.offset, meta)
                finally:
                    os.close(fd)
            os.close(shm.open_checked(response.path, response.offset, meta.nbytes))  # validate it
            adopted = Segment.adopt(response.path)  # renamed to one of our names
            if adopted is None:
                fd = shm.open_checked(response.path, response.offset, meta.nbytes)
                try:
                    return shm.read_segment(fd, response.offset, meta)
                finally:
                    os.close(fd)
                    shm.unlink(response.path)
            try:
                return adopted.lend(pool, response.offset, meta)
            except BaseException:
                adopted.destroy()
                raise
        except InvalidArgument as err:
            if shm.is_worker_segment(response.path) and response.path != request.path:
                shm.unlink(response.path)
            raise error_for_code(
                grpc.StatusCode.INTERNAL, f"{what}: unusable shared-memory segment: {err.message}"
            ) from None
    finally:
        if lease is not None:
            pool.release(lease)


# Codes a worker answers with once its handler is done (the other codes may also
# mean that the client stopped waiting while the handler runs on).
_ANSWER_CODES = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


def _answered(err: BaseException) -> bool:
    """Whether a failed call was the worker's answer, so its handler has finished."""
    return isinstance(err, CollectiveError) and err.code in _ANSWER_CODES


def is_retryable_read(err: CollectiveError) -> bool:
    """Idempotent calls (reads, put, delete) are retried on UNAVAILABLE only."""
    return err.code == grpc.StatusCode.UNAVAILABLE
