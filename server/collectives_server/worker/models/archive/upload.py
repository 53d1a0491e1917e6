"""LoadModel's upload: the archive streamed to a private temp file, counted as it arrives.

Nothing is buffered in memory but one gRPC message: each chunk is written to a
file (mode 0600) in ``--model-upload-dir`` (default: a private 0700 temp dir),
and the running count is checked against the declared size and
``--max-model-bytes`` before it is written. The file is then checked and
rewritten by :mod:`archive`, tried by :mod:`archive_canary` and loaded from disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.export.passes import move_to_device_pass

from collectives.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from collectives.wire.names import ARCHIVE_PREFIX, validate_name
from collectives_server.worker.models.archive.canary import trial_load
from collectives_server.worker.models.archive.checks import ModelUploadConfig, check_archive

if TYPE_CHECKING:
    from collectives_server.worker.data.store import TensorStore

__all__ = ["ModelUploadConfig", "ModelUploads", "ReceivedModel", "on_device"]

# Two concurrent torch.export.load calls fail ("_CURRENT_DESERIALIZER is already
# set"): two clients' load_model at once, or a peer's model arriving (model_sync).
_EXPORT_LOAD = threading.Lock()


@dataclass
class ReceivedModel:
    spec: object  # worker_pb2.ModelSpec
    archive: Path | None  # the upload on disk (None: a factory)


def on_device(program: torch.export.ExportedProgram, device: torch.device | None):
    """``program`` with everything it holds and makes on ``device`` (None or the CPU:
    as loaded). ``Module.to()`` on the loaded module would move its parameters and
    buffers but leave its lifted constants, and the ``device=cpu`` that export baked
    into factory ops (``arange``, ``zeros``, ``full``...), on the CPU: the first
    forward on a GPU would then mix devices. torch's ``move_to_device_pass`` rewrites
    both."""
    if device is None or device.type == "cpu":
        return program
    return move_to_device_pass(program, device)


class ModelUploads:
    """A worker's model uploads: receiving, checking, loading; one directory."""

    def __init__(self, config: ModelUploadConfig, device: torch.device | None = None) -> None:
        self.config = config
        # Where the loaded programs run (the worker's first device): an exported
        # program is moved there by torch's export pass, not by Module.to().
        self.device = device
        self._lock = threading.Lock()
        self._owned = config.upload_dir is None
        self._dir: Path | None = None
        if config.upload_dir is not None:
            self._dir = Path(config.upload_dir)
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self._dir, 0o700)

    @property
    def dir(self) -> Path:
        """Where archives are checked and kept: ``--model-upload-dir``, or a private
        temporary directory made with the first archive (a worker that never gets
        one, or is killed, leaves none behind)."""
        with self._lock:
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="collectives-models-"))  # mode 0700
            return self._dir

    def close(self) -> None:
        with self._lock:
            made, self._dir = self._dir, None
        if self._owned and made is not None:
            shutil.rmtree(made, ignore_errors=True)

    def _refuse_if_off(self) -> None:
        if not self.config.allow:
            raise PermissionDenied(
                "this worker does not accept model archives: start it with "
                "--allow-model-upload (or configure --token-file), or load a model "
                "with a factory (--allow-factory)"
            )

    @contextmanager
    def receive(
        self, request_iterator, store: TensorStore | None = None
    ) -> Iterator[ReceivedModel]:
        """Reads LoadModel's stream; the archive (if any) lives on disk until the block ends.

        A spec naming ``archive_tensor`` carries no chunks: the archive is that
        tensor of ``store`` (staged by a replicated put), copied to the same kind
        of temp file as streamed chunks and deleted from the store, so every
        check after this one is the streamed archive's."""
        spec = None
        path: Path | None = None
        out = None
        written = 0
        try:
            for part in request_iterator:
                which = part.WhichOneof("part")
                if which == "spec":
                    if spec is not None:
                        raise InvalidArgument("LoadModel stream carries a second spec")
                    spec = part.spec
                    validate_name(spec.name, "model name")
                    if not spec.factory:
                        self._refuse_if_off()
                    if spec.archive_nbytes > self.config.max_bytes:
                        raise ResourceExhausted(
                            f"model archive of {spec.archive_nbytes} bytes is larger than "
                            f"this worker's --max-model-bytes {self.config.max_bytes}"
                        )
                elif which == "archive_chunk":
                    if spec is None:
                        raise InvalidArgument("LoadModel stream must start with a spec")
                    if spec.factory:
                        raise InvalidArgument("send either a factory or an archive, not both")
                    if spec.archive_tensor:
                        raise InvalidArgument(
                            "send either archive chunks or an archive_tensor, not both"
                        )
                    chunk = part.archive_chunk
                    written += len(chunk)
                    if written > spec.archive_nbytes:
                        raise InvalidArgument("model archive is longer than its declared size")
                    if out is None:
                        fd, name = tempfile.mkstemp(suffix=".upload", dir=self.dir)
                        path, out = Path(name), os.fdopen(fd, "wb")
                    out.write(chunk)
            if spec is None:
                raise InvalidArgument("LoadModel stream was empty: send a spec first")
            if spec.archive_tensor:
                if spec.factory:
                    raise InvalidArgument("send either a factory or an archive, not both")
                path = self._from_store(spec, store)
                written = spec.archive_nbytes
            if out is not None:
                out.close()
                out = None
            if not spec.factory and written != spec.archive_nbytes:
                raise InvalidArgument(
                    f"model archive ended after {written} of {spec.archive_nbytes} bytes"
                )
            yield ReceivedModel(spec, path)
        except BaseException:
            # This frame stays in the traceback gRPC keeps: not with the last chunk.
            part = chunk = None
            raise
        finally:
            if out is not None:
                out.close()
            if path is not None:
                path.unlink(missing_ok=True)

    def _from_store(self, spec, store: TensorStore | None) -> Path:
        """Copies the staged archive tensor to a temp file, then deletes it from the store."""
        name = spec.archive_tensor
        validate_name(name, "archive_tensor")
        if not name.startswith(ARCHIVE_PREFIX):
            raise InvalidArgument(
                f"archive_tensor {name[:64]!r} must be a staged archive under {ARCHIVE_PREFIX!r}"
            )
        if store is None:
            raise InvalidArgument("this LoadModel cannot read an archive_tensor")
        # The fenced read: a follower commits the replicated put that staged the archive
        # a moment after the leader answered it; peek() could miss it, and the client
        # would then stream the archive and leave the staged copy behind.
        try:
            t = store.get(name)
        except NotFound:
            raise NotFound(
                f"no staged archive {name!r} on this worker (expired or deleted?)"
            ) from None
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != spec.archive_nbytes:
            raise InvalidArgument(
                f"archive_tensor {name!r} must be a 1-D uint8 tensor of archive_nbytes="
                f"{spec.archive_nbytes} bytes; it is {str(t.dtype).removeprefix('torch.')} "
                f"of shape {tuple(t.shape)}"
            )
        data = t.detach().to("cpu").contiguous().numpy()
        fd, tmp = tempfile.mkstemp(suffix=".upload", dir=self.dir)
        path = Path(tmp)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(memoryview(data))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        # Read: the bytes now live in the temp file (as streamed chunks would), so
        # the store need not hold them through the checks and the load.
        store.delete_if_same(name, t)
        return path

    def load(self, upload: Path, keep: Path | None = None) -> nn.Module:
        """Checks, rewrites, (sandbox-)loads the uploaded archive; the module.

        ``keep``: where to leave the checked archive (a peer catching up on the
        model is sent it, see ``model_sync``); otherwise it is deleted."""
        checked = upload.with_suffix(".pt2")
        try:
            check_archive(upload, checked, self.config.limits)
            upload.unlink(missing_ok=True)  # free the disk: torch reads only the checked copy
            if self.config.load_sandbox:
                trial_load(checked, self.config.load_timeout_s)
            try:
                with _EXPORT_LOAD:  # torch.export.load keeps global state: one at a time
                    program = torch.export.load(str(checked))
                module = on_device(program, self.device).module()
            except Exception as exc:
                raise InvalidArgument(
                    f"could not load the torch.export archive: {type(exc).__name__}: "
                    f"{str(exc)[:300]}"
                ) from None
            if keep is not None:
                checked.replace(keep)
            return module
        finally:
            checked.unlink(missing_ok=True)

    def load_peer_archive(self, archive: torch.Tensor) -> tuple[nn.Module, Path]:
        """A peer's archive (its bytes, uint8) checked and loaded like a client's upload;
        the module, and where the checked archive is kept for the next joiner."""
        upload = self.kept_path(".upload")
        upload.write_bytes(archive.cpu().numpy().tobytes())  # host bytes already: no copy
        kept = self.kept_path()
        try:
            module = self.load(upload, keep=kept)
        except BaseException:
            kept.unlink(missing_ok=True)
            raise
        finally:
            upload.unlink(missing_ok=True)
        return module, kept

    def kept_path(self, suffix: str = ".kept.pt2") -> Path:
        """A fresh path in the upload directory (a checked archive to keep, by default)."""
        fd, name = tempfile.mkstemp(suffix=suffix, dir=self.dir)
        os.close(fd)
        return Path(name)
