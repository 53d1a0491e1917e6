"""The documentation's examples run as pasted: every fenced block of README.md and
docs/*.md marked runnable is executed against a real local cluster of 2 workers.

A block is marked by an HTML comment on the line right before its opening fence
(it does not render)::

    <!-- runnable -->
    ```python
    ...
    ```

``python`` blocks run with this interpreter in a subprocess (cwd: a fresh temp
dir); ``sh`` blocks run in bash with ``.venv/bin/`` pointing at this
interpreter's bin dir. In both, the address ``127.0.0.1:50051`` the docs use is
replaced by the test cluster's coordinator address. Each block must exit 0
within ``BLOCK_TIMEOUT_S``. Only short, bounded commands belong in a runnable
sh block: one that starts a server is refused here rather than left hanging.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
DOC_ADDRESS = "127.0.0.1:50051"
BLOCK_TIMEOUT_S = 120
LANGUAGES = ("python", "sh")
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)\s*$")
# Commands that never end by themselves: not for a runnable block.
_LONG_RUNNING = ("collectives-server", "--watch")


@dataclass(frozen=True)
class Block:
    path: Path  # relative to ROOT
    line: int  # 1-based line of the opening fence
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _closes(line: str, fence: str) -> bool:
    """A closing fence: only the opening's character, at least as many (CommonMark)."""
    stripped = line.strip()
    return len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The fenced blocks of ``path`` whose opening fence follows a ``MARKER`` line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not _closes(lines[end], opening["fence"]):
            end += 1
        if i > 0 and lines[i - 1].strip() == MARKER:
            blocks.append(
                Block(path.relative_to(root), i + 1, opening["lang"], "\n".join(lines[i + 1 : end]))
            )
        i = end + 1
    return blocks


ALL_BLOCKS = [block for path in doc_files() for block in runnable_blocks(path)]


def test_runnable_blocks_exist() -> None:
    assert ALL_BLOCKS, f"no block of README.md or docs/*.md is marked {MARKER!r}"
    in_readme = [b for b in ALL_BLOCKS if b.path == Path("README.md")]
    assert len(in_readme) >= 2, [b.id for b in in_readme]
    for block in ALL_BLOCKS:
        assert block.lang in LANGUAGES, f"{block.id}: cannot run a {block.lang!r} block"
        assert block.text.strip(), f"{block.id}: empty block"


def test_marker_is_an_html_comment_on_its_own_line() -> None:
    """The marker renders as nothing: an HTML comment alone on its line, right before a fence."""
    for path in doc_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if "runnable -->" not in line:
                continue
            where = f"{path.relative_to(ROOT)}:{n + 1}"
            assert line.strip() == MARKER, f"{where}: the marker must be alone on its line"
            assert n + 1 < len(lines) and _FENCE.match(lines[n + 1]), (
                f"{where}: the marker must be right before a fence"
            )


def test_block_extraction(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "# t",
            MARKER,
            "```python",
            "print(1)",
            "```",
            "```python",
            "print('not marked')",
            "```",
            MARKER,
            "````sh",
            "```",
            "echo nested",
            "````",
        ]
    )
    path = tmp_path / "probe.md"
    path.write_text(text)
    blocks = runnable_blocks(path, root=tmp_path)
    assert [(b.line, b.lang, b.text) for b in blocks] == [
        (3, "python", "print(1)"),
        (10, "sh", "```\necho nested"),
    ]


@pytest.fixture(scope="module")
def address(cluster2_address: str, cluster2) -> str:  # cluster2: waits until every worker is ready
    return cluster2_address


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_block_runs(block: Block, address: str, tmp_path: Path) -> None:
    text = block.text.replace(DOC_ADDRESS, address)
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(text + "\n")
        argv = [sys.executable, str(script)]
    else:
        for command in _LONG_RUNNING:
            assert command not in text, f"{block.id}: {command!r} does not end by itself"
        bin_dir = str(Path(sys.executable).parent)
        argv = ["bash", "-e", "-c", text.replace(".venv/bin/", bin_dir + "/")]
    try:
        done = subprocess.run(
            argv,
            cwd=tmp_path,
            env=dict(os.environ, COLUMNS="200"),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id} did not finish within {BLOCK_TIMEOUT_S} s\n{exc.stderr or ''}")
    assert done.returncode == 0, (
        f"{block.id} exited with {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
        f"\n--- stderr\n{done.stderr[-4000:]}"
    )
