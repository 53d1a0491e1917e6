"""The Worker RPCs of a drain's handoff, answered by the drained worker to its
successor (see :mod:`collectives_server.worker.transport.handoff`)."""

from __future__ import annotations

import os

import torch

from collectives.errors import InvalidArgument, NotFound
from collectives.v1 import worker_pb2
from collectives.wire import codec
from collectives.wire.names import FUNCTION_PREFIX, validate_name
from collectives_server.rpc.limits import RpcLimits
from collectives_server.worker.context import WorkerContext
from collectives_server.worker.rpc.bulk_answers import tensor_answer
from collectives_server.worker.rpc.guards import guard as _guard

__all__ = ["HandoffRpcs"]

_MAX_WAIT_S = RpcLimits().max_rpc_s
# Tensors one HandoffTensors call may ask for.
MAX_HANDOFF_ITEMS = 1024


class HandoffRpcs:
    """Handoff and HandoffTensors, over the worker's :attr:`WorkerContext.handoff`."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx

    @_guard
    def Handoff(self, r: worker_pb2.HandoffRequest, context) -> worker_pb2.HandoffManifest:
        remaining = context.time_remaining()
        # Answered before the caller's deadline: a refusal says why, not "deadline".
        wait_s = self._ctx.op_timeout_s if remaining is None else min(remaining, _MAX_WAIT_S)
        wait_s -= min(1.0, 0.1 * wait_s)
        source = self._ctx.handoff
        snapshot = ""
        if r.ahead:
            tensors, snapshot = source.ahead_offer(r.generation_after, max(wait_s, 0.0))
        else:
            tensors = source.manifest(r.generation_after, max(wait_s, 0.0))
        bulk = self._ctx.bulk
        manifest = worker_pb2.HandoffManifest(
            bulk_port=bulk.port if bulk is not None else 0,
            models=[n for n in self._ctx.models.names() if not n.startswith(FUNCTION_PREFIX)],
        )
        unchanged = set()
        if r.ahead:
            manifest.ahead_snapshot = snapshot
            manifest.model_builds.extend(self._model_builds())
        elif r.ahead_snapshot:
            unchanged = source.unchanged(r.generation_after, r.ahead_snapshot)
        manifest.unchanged.extend(sorted(unchanged))
        for name, tensor in sorted(tensors.items()):
            if name in unchanged:
                continue
            header = codec.make_header(name, tensor)
            manifest.tensors.append(header)
            manifest.total_bytes += header.nbytes
        if r.ahead:  # (the gradients move after the seal: a backward may still run)
            return manifest
        for (model, key), grad in sorted(source.gradients(r.generation_after).items()):
            header = codec.make_header(key, grad)
            manifest.gradients.add(model=model, header=header)
            manifest.total_bytes += header.nbytes
        return manifest

    def _model_builds(self) -> list[worker_pb2.ModelSpec]:
        builds = []
        for model in self._ctx.models.all():
            d = model.definition
            if model.name.startswith(FUNCTION_PREFIX):
                continue
            try:
                archive = d.archive.stat().st_size if d.archive is not None else 0
            except FileNotFoundError:  # (the model was removed meanwhile)
                archive = 0
            if d.factory or archive:
                builds.append(
                    worker_pb2.ModelSpec(
                        name=model.name,
                        factory=d.factory,
                        factory_kwargs_json=d.kwargs_json,
                        archive_nbytes=archive,
                    )
                )
        return builds

    def _archive(self, model: str) -> torch.Tensor:
        """Model ``model``'s checked archive, read into one buffer (uint8)."""
        held = self._ctx.models.peek(model)
        archive = held.definition.archive if held is not None else None
        try:
            if archive is None:
                raise FileNotFoundError
            with archive.open("rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(data) != len(data) or not data:
                    raise FileNotFoundError  # (replaced meanwhile)
        except FileNotFoundError:
            raise NotFound(f"model {model!r} has no archive on this worker") from None
        return torch.frombuffer(data, dtype=torch.uint8)

    @_guard
    def HandoffTensors(
        self, r: worker_pb2.HandoffTensorsRequest, context
    ) -> worker_pb2.HandoffTensorsResponse:
        if len(r.items) > MAX_HANDOFF_ITEMS:
            raise InvalidArgument(
                f"{len(r.items)} tensors in one HandoffTensors call; at most {MAX_HANDOFF_ITEMS}"
            )
        for item in r.items:
            if item.model:
                validate_name(item.model, "model name")
            if item.name or not item.model:
                validate_name(item.name)
        remaining = context.time_remaining()
        ttl = self._ctx.op_timeout_s if remaining is None else min(remaining, _MAX_WAIT_S)
        response = worker_pb2.HandoffTensorsResponse()
        for item in r.items:
            if item.archive:
                self._ctx.handoff.ahead_offer(r.generation_after, 0.0)  # (being drained)
                name, tensor = item.model, self._archive(item.model)
            else:
                name = item.name
                tensor = self._ctx.handoff.tensor(
                    r.generation_after,
                    item.name,
                    item.model,
                    ahead_snapshot=r.ahead_snapshot if r.ahead else "",
                )
            answer = tensor_answer(name, tensor, None, self._ctx.bulk, max(ttl, 0.0))
            response.tensors.append(answer)
            self._ctx.stats.add_bytes(sent=answer.header.nbytes)
        return response
