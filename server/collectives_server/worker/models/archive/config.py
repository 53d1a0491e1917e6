"""How a worker takes model archives (the --allow-model-upload ... flags); no torch here."""

from __future__ import annotations

from dataclasses import dataclass

from collectives_server.worker.models.archive.checks import ArchiveLimits, GiB, MiB

__all__ = ["ModelUploadConfig"]


@dataclass(frozen=True)
class ModelUploadConfig:
    # Whether LoadModel accepts archives at all (factories are unaffected).
    allow: bool = False
    max_bytes: int = 4 * GiB
    max_entries: int = 65536
    max_json_bytes: int = 256 * MiB
    # Where uploads are written; None: a private temp dir (0700) made at start.
    upload_dir: str | None = None
    # Try each archive in a limited child process first.
    load_sandbox: bool = True
    load_timeout_s: float = 120.0

    @property
    def limits(self) -> ArchiveLimits:
        return ArchiveLimits(self.max_bytes, self.max_entries, self.max_json_bytes)
