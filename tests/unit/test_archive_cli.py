"""The model-archive flags of ``worker`` and ``local``: names and defaults."""

from __future__ import annotations

from pathlib import Path

from collectives_server.cli.local import worker_config_from_args
from collectives_server.cli.main import build_parser
from collectives_server.cli.worker import config_from_args
from collectives_server.settings import to_argv

GiB, MiB = 1 << 30, 1 << 20


def _worker(*flags: str):
    return config_from_args(build_parser().parse_args(["worker", "--coordinator", "h:1", *flags]))


def test_worker_defaults_uploads_off_without_token_sandbox_on():
    cfg = _worker().model_upload
    assert (cfg.allow, cfg.load_sandbox) == (False, True)
    assert (cfg.max_bytes, cfg.max_entries, cfg.max_json_bytes) == (4 * GiB, 65536, 256 * MiB)
    assert (cfg.upload_dir, cfg.load_timeout_s) == (None, 120.0)


def test_worker_uploads_on_with_a_token_or_the_flag(tmp_path: Path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-for-tests\n")
    token.chmod(0o600)
    assert _worker(f"--token-file={token}").model_upload.allow
    assert _worker("--allow-model-upload").model_upload.allow
    assert not _worker(f"--token-file={token}", "--no-allow-model-upload").model_upload.allow


def test_worker_bounds_parse_units():
    cfg = _worker(
        "--max-model-bytes=64MiB",
        "--max-model-entries=10",
        "--max-model-json-bytes=1MiB",
        "--model-upload-dir=/tmp/up",
        "--no-load-sandbox",
        "--model-load-timeout-s=7.5",
    ).model_upload
    assert (cfg.max_bytes, cfg.max_entries, cfg.max_json_bytes) == (64 * MiB, 10, MiB)
    assert (cfg.upload_dir, cfg.load_sandbox, cfg.load_timeout_s) == ("/tmp/up", False, 7.5)


def test_local_defaults_uploads_on_sandbox_off_and_forwards_bounds():
    args = build_parser().parse_args(["local", "--workers", "2", "--max-model-bytes=1GiB"])
    forwarded = to_argv(worker_config_from_args(args))
    assert "--allow-model-upload" in forwarded and "--no-load-sandbox" in forwarded
    assert f"--max-model-bytes={GiB}" in forwarded
    args = build_parser().parse_args(
        ["local", "--workers", "2", "--no-allow-model-upload", "--load-sandbox"]
    )
    forwarded = to_argv(worker_config_from_args(args))
    assert "--no-allow-model-upload" in forwarded and "--load-sandbox" in forwarded
    # What local forwards, a worker parses.
    cfg = _worker(*forwarded).model_upload
    assert (cfg.allow, cfg.load_sandbox) == (False, True)
