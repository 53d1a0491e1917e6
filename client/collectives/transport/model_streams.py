"""Model RPCs that stream: shipping archives, and tensor dicts in raw frames.

State dicts and gradients travel as a sequence of raw-framed tensors (header,
chunks, header, chunks, ...) on the same codec as PutTensor/GetTensor, keyed by
parameter name; the model name of LoadStateDict travels in request metadata.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import torch

from collectives._progress import NO_PROGRESS, Progress
from collectives.errors import InvalidArgument, channel_was_closed, closed_handle, error_for_code
from collectives.errors import from_rpc_error as _from_rpc_error
from collectives.transport.endpoints import WorkerEndpoint
from collectives.v1 import worker_pb2
from collectives.wire import codec

__all__ = ["load_model_on", "get_model_tensors"]

_GET_MODEL_TENSORS = "/collectives.v1.Worker/GetModelTensors"


def load_model_on(
    endpoint: WorkerEndpoint,
    spec: worker_pb2.ModelSpec,
    archive: bytes,
    timeout: float,
    progress: Progress = NO_PROGRESS,
) -> worker_pb2.LoadModelResponse:
    def messages(sent: Progress) -> Iterator[worker_pb2.LoadModelRequest]:
        yield worker_pb2.LoadModelRequest(spec=spec)
        view = memoryview(archive)
        for start in range(0, len(view), codec.CHUNK_BYTES):
            chunk = view[start : start + codec.CHUNK_BYTES]
            yield worker_pb2.LoadModelRequest(archive_chunk=bytes(chunk))
            sent.advance(len(chunk))

    what = f"LoadModel {spec.name!r} on {endpoint.address}"
    try:
        with progress.attempt() as sent:
            return endpoint.stub.LoadModel(messages(sent), timeout=timeout)
    except grpc.RpcError as err:
        raise _from_rpc_error(err, what) from None
    except ValueError as err:
        if not channel_was_closed(err):
            raise
        raise closed_handle(what) from None


def get_model_tensors(
    endpoint: WorkerEndpoint, model: str, which: str, timeout: float
) -> dict[str, torch.Tensor]:
    what = f"{which} of model {model!r} from {endpoint.address}"
    try:
        call = endpoint.channel.unary_stream(
            _GET_MODEL_TENSORS,
            request_serializer=worker_pb2.ModelTensorsRequest.SerializeToString,
            response_deserializer=None,
        )(worker_pb2.ModelTensorsRequest(model=model, which=which), timeout=timeout)
    except ValueError as err:
        if not channel_was_closed(err):
            raise
        raise closed_handle(what) from None
    try:
        return codec.assemble_named_tensors(call, "GetModelTensors")
    except grpc.RpcError as err:
        raise _from_rpc_error(err, what) from None
    except InvalidArgument as err:
        call.cancel()
        raise error_for_code(
            grpc.StatusCode.INTERNAL, f"{what}: malformed response stream: {err.message}"
        ) from None
