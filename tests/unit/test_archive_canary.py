"""The load sandbox (archive_canary.py): a child process loads the checked archive first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hostile_archives import SmallModel, legit_archive, rewrite

from collectives.errors import DeadlineExceeded, InvalidArgument
from collectives_server.worker.models.archive.canary import _world_can_reach, trial_load
from collectives_server.worker.models.archive.checks import ArchiveLimits, check_archive

pytestmark = pytest.mark.timeout(120)


def _checked(tmp_path: Path, data: bytes) -> Path:
    src, dst = tmp_path / "upload.bin", tmp_path / "checked.pt2"
    src.write_bytes(data)
    check_archive(src, dst, ArchiveLimits())
    return dst


def test_a_good_archive_loads_in_the_sandbox(tmp_path, gen):
    trial_load(_checked(tmp_path, legit_archive(SmallModel(gen), torch.randn(3, 6))), 60.0)


def test_an_archive_torch_cannot_load_is_invalid_argument(tmp_path, gen):
    base = legit_archive(SmallModel(gen), torch.randn(3, 6))
    short = torch.randn(2, generator=gen).numpy().tobytes()  # weight_0 needs 4 x 6 floats
    path = _checked(tmp_path, rewrite(base, replace={"data/weights/weight_0": short}))
    with pytest.raises(InvalidArgument, match="failed to load in the load sandbox"):
        trial_load(path, 60.0)


def test_a_load_past_the_timeout_is_deadline_exceeded(tmp_path, gen):
    path = _checked(tmp_path, legit_archive(SmallModel(gen), torch.randn(3, 6)))
    with pytest.raises(DeadlineExceeded, match="--model-load-timeout-s"):
        trial_load(path, 0.05)  # not even torch imports that fast


def test_privilege_drop_needs_a_world_reachable_interpreter(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    inside = private / "python"
    inside.write_bytes(b"")
    inside.chmod(0o755)
    assert not _world_can_reach(str(inside))
    private.chmod(0o755)
    tmp_path.chmod(0o755)
    reachable = all(os.stat(p).st_mode & 0o001 for p in [*Path(tmp_path).parents])
    assert _world_can_reach(str(inside)) == reachable
