"""The model-archive allowlist alone (``worker/models/archive/checks.py``, ``graph.py``):
fast, no cluster.

Also shows the hostile builders are real: torch.export.load on the raw legacy-layout
and opaque-constant archives runs their payload (creates the marker); our check refuses them first.
"""

from __future__ import annotations

import contextlib
import io
import resource
import zipfile
from pathlib import Path

import pytest
import torch
from hostile_archives import (
    HOSTILE,
    SmallModel,
    encrypted_flag,
    guards_code,
    legit_archive,
    rewrite,
    zip_bomb,
)

from collectives.errors import InvalidArgument
from collectives_server.worker.models.archive.checks import ArchiveLimits, check_archive
from collectives_server.worker.models.archive.graph import check_expr

MiB = 1 << 20


@pytest.fixture
def base(gen: torch.Generator) -> bytes:
    return legit_archive(SmallModel(gen), torch.randn(3, 6, generator=gen))


def _check(tmp_path: Path, data: bytes, limits: ArchiveLimits | None = None) -> Path:
    src, dst = tmp_path / "upload.bin", tmp_path / "checked.pt2"
    src.write_bytes(data)
    check_archive(src, dst, limits or ArchiveLimits())
    return dst


def test_legit_archive_loads_and_runs_like_the_original(tmp_path, gen):
    model = SmallModel(gen)
    example = torch.randn(3, 6, generator=gen)
    checked = _check(tmp_path, legit_archive(model, example))
    names = zipfile.ZipFile(checked).namelist()
    sample = next(n for n in names if "/data/sample_inputs/" in n)
    assert zipfile.ZipFile(checked).read(sample) == b"", "sample inputs (a pickle) are dropped"
    loaded = torch.export.load(str(checked)).module()
    assert torch.equal(loaded(example), model(example))


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_archive_refused_and_nothing_runs(name, tmp_path, base, gen):
    marker = tmp_path / "marker"
    data = HOSTILE[name](base, str(marker), gen)
    with pytest.raises(InvalidArgument, match="refused") as err:
        _check(tmp_path, data)
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert not marker.exists()
    assert not (tmp_path / "checked.pt2").exists()


@pytest.mark.parametrize("name", ["legacy_layout", "opaque_obj_constant", "use_pickle_weight"])
def test_payloads_do_run_under_plain_torch_export_load(name, tmp_path, base, gen):
    """The attacks are real: unchecked, torch.export.load executes the pickle."""
    marker = tmp_path / "marker"
    data = HOSTILE[name](base, str(marker), gen)
    # torch may fail after the payload ran; that is the point.
    with contextlib.suppress(Exception):
        torch.export.load(io.BytesIO(data))
    assert marker.exists()


def test_zip_bomb_refused_with_bounded_memory(tmp_path, base):
    bomb = zip_bomb(base, entry_mib=768)
    assert len(bomb) < 2 * MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with pytest.raises(InvalidArgument, match="decompresses to more than"):
        _check(tmp_path, bomb)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 64 * MiB, f"peak RSS grew by {grown / MiB:.0f} MiB"
    assert not (tmp_path / "checked.pt2").exists()


def test_total_size_and_entry_count_bounds(tmp_path, base):
    with pytest.raises(InvalidArgument, match="--max-model-bytes"):
        _check(tmp_path, base, ArchiveLimits(max_bytes=64))
    with pytest.raises(InvalidArgument, match="--max-model-entries"):
        _check(tmp_path, base, ArchiveLimits(max_entries=5))
    with pytest.raises(InvalidArgument, match="decompresses to more than"):
        _check(tmp_path, base, ArchiveLimits(max_json_bytes=100))


def test_duplicate_and_encrypted_entries_refused(tmp_path, base):
    root = zipfile.ZipFile(io.BytesIO(base)).namelist()[0].split("/")[0]
    with pytest.warns(UserWarning, match="Duplicate name"):
        dup = rewrite(base, add={f"{root}/archive_format": b"pt2"}, raw_names=True)
    with pytest.raises(InvalidArgument, match="appears twice"):
        _check(tmp_path, dup)
    with pytest.raises(InvalidArgument, match="encrypted"):
        _check(tmp_path, encrypted_flag(base))


def test_unnamed_payload_and_oversized_payload_refused(tmp_path, base, gen):
    extra = torch.randn(8, generator=gen).numpy().tobytes()
    with pytest.raises(InvalidArgument, match="named by no"):
        _check(tmp_path, rewrite(base, add={"data/weights/weight_7": extra}))
    with pytest.raises(InvalidArgument, match="decompresses to more than"):
        _check(tmp_path, rewrite(base, replace={"data/weights/weight_0": extra * 64}))


@pytest.mark.parametrize(
    "expr",
    [
        "Symbol('s77', positive=True, integer=True)",
        "s0*s1 + FloorDiv(s2, 4) - 1",
        "Max(2, u0) >= 3",
        # the stride of dim 0 when dim 1 is the dynamic one (load_model(batch_dim=1))
        "Mul(Integer(4), Symbol('s27', positive=True, integer=True))",
        "Add(Mul(Integer(6), Symbol('s0', integer=True)), Pow(Symbol('s1'), Integer(2)))",
    ],
)
def test_symbolic_expressions_torch_writes_pass(expr):
    check_expr(expr)


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('id')",
        "s0.__class__",
        "Symbol('s0').func",
        "plot(s0)",
        "var('x')",
        "s0[0]",
        "lambda: 1",
        'Symbol("s0")',
    ],
)
def test_symbolic_expressions_beyond_arithmetic_refused(expr):
    with pytest.raises(InvalidArgument):
        check_expr(expr)


def test_dtype_sizes_match_torch():
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    from collectives_server.worker.models.archive.checks import _DTYPE_BYTES

    assert {int(k): v.itemsize for k, v in _SERIALIZE_TO_TORCH_DTYPE.items()} == _DTYPE_BYTES


def test_guards_code_is_dropped_so_never_executed(tmp_path, gen):
    model = SmallModel(gen)
    example = torch.randn(3, 6, generator=gen)
    marker = tmp_path / "marker"
    hostile = guards_code(legit_archive(model, example), str(marker))
    with contextlib.suppress(Exception):  # unchecked, torch runs the guard on forward
        torch.export.load(io.BytesIO(hostile)).module()(example)
    assert marker.exists()
    marker.unlink()
    checked = _check(tmp_path, hostile)
    loaded = torch.export.load(str(checked)).module()
    assert torch.equal(loaded(example), model(example))
    assert not marker.exists()
