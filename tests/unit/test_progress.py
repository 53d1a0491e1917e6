"""Progress bars (collectives._progress): when one is shown, and that it adds up."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from collectives import _progress
from collectives._progress import (
    NO_PROGRESS,
    PROGRESS_ENV,
    PROGRESS_MIN_BYTES,
    Deferred,
    progress,
    setting,
)
from collectives.wire import codec

ROOT = Path(__file__).resolve().parents[2]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _count(bar: _progress.Progress) -> int:
    return bar._bar.n  # the tqdm bar's count


@pytest.mark.parametrize(
    ("keyword", "env", "expected"),
    [
        (None, None, None),
        (None, "0", False),
        (None, "off", False),
        (None, "1", True),
        (None, "", None),
        (False, "1", False),
        (True, "0", True),
    ],
)
def test_the_keyword_beats_the_environment(monkeypatch, keyword, env, expected) -> None:
    if env is None:
        monkeypatch.delenv(PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(PROGRESS_ENV, env)
    assert setting(keyword) is expected


def test_no_bar_below_the_threshold_off_a_terminal_or_when_disabled() -> None:
    big = PROGRESS_MIN_BYTES
    assert progress("x", big - 1, True, file=_Tty()) is NO_PROGRESS
    assert progress("x", big, None, file=io.StringIO()) is NO_PROGRESS  # not a TTY
    assert progress("x", big, False, file=_Tty()) is NO_PROGRESS
    with Deferred("x", False, file=_Tty()) as deferred:
        assert deferred.start(big) is NO_PROGRESS
    # The no-op bar takes anything and stays a no-op.
    with NO_PROGRESS.attempt() as sent:
        sent.advance(5)
    NO_PROGRESS.close()


def test_a_terminal_gets_a_bar_by_default() -> None:
    out = _Tty()
    with progress("put 'x'", PROGRESS_MIN_BYTES, None, file=out) as bar:
        assert bar is not NO_PROGRESS
        bar.advance(PROGRESS_MIN_BYTES)
    assert "put 'x'" in out.getvalue() and "100%" in out.getvalue()


def test_without_a_bar_tqdm_is_never_imported() -> None:
    # torch imports tqdm itself, so this runs where torch is not imported (the CLI).
    script = """
import sys
import collectives.cli.main
from collectives._progress import Deferred, progress, NO_PROGRESS, PROGRESS_MIN_BYTES
assert progress("a", 1 << 40) is NO_PROGRESS  # stderr is a pipe here
assert progress("b", PROGRESS_MIN_BYTES - 1, True) is NO_PROGRESS
assert progress("c", 1 << 40, False) is NO_PROGRESS
with Deferred("d", None) as deferred:
    assert deferred.start(1 << 40) is NO_PROGRESS
assert "torch" not in sys.modules and "tqdm" not in sys.modules
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'client'}{os.pathsep}{ROOT / 'server'}"}
    env.pop(PROGRESS_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_a_forced_bar_adds_up_from_many_threads() -> None:
    out = io.StringIO()  # not a terminal: forced on
    total = PROGRESS_MIN_BYTES * 3
    threads, pieces = 8, 96
    piece = total // (threads * pieces)
    assert piece * threads * pieces == total
    bar = progress("put 'y'", total, True, file=out)

    def work() -> None:
        for _ in range(pieces):
            with bar.attempt() as sent:
                sent.advance(piece)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert _count(bar) == total
    bar.close()
    assert "100%" in out.getvalue() and "768M" in out.getvalue()


def test_a_failed_try_takes_its_bytes_back() -> None:
    bar = progress("put 'z'", PROGRESS_MIN_BYTES, True, file=io.StringIO())
    with pytest.raises(OSError), bar.attempt() as sent:
        sent.advance(1000)
        raise OSError("connection reset")
    assert _count(bar) == 0
    with bar.attempt() as sent:
        sent.advance(PROGRESS_MIN_BYTES)
    assert _count(bar) == PROGRESS_MIN_BYTES
    bar.close()


def test_the_stream_encoder_counts_payload_bytes() -> None:
    t = torch.arange(3 * 1000, dtype=torch.float64)
    bar = progress("put 't'", PROGRESS_MIN_BYTES, True, file=io.StringIO())
    frames = list(codec.encode_tensor_stream("t", t, chunk_bytes=1000, progress=bar))
    assert len(frames) == 1 + 24 and _count(bar) == t.numel() * 8
    bar.close()


def test_a_deferred_bar_starts_with_the_size_and_restarts_on_a_retry() -> None:
    out = io.StringIO()
    with Deferred("get 'w'", True, file=out) as deferred:
        first = deferred.start(PROGRESS_MIN_BYTES)
        first.advance(10)
        second = deferred.start(PROGRESS_MIN_BYTES)
        assert second is not first
        second.advance(PROGRESS_MIN_BYTES)
    assert _count(second) == PROGRESS_MIN_BYTES and "100%" in out.getvalue()
