"""Every module and repository path the docs and docstrings name exists.

Files move (the tree is the map, and maps change); a reference left behind
sends a reader nowhere. Checked: ``collectives.x`` / ``collectives_server.x``
dotted names and ``*.py`` / folder paths in ``README.md``, ``docs/*.md`` and the
docstrings and comments of ``client/``, ``server/``, ``tests/`` and ``bench/``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"collectives": ROOT / "client", "collectives_server": ROOT / "server"}
DOTTED = re.compile(r"(?<![\w./-])((?:collectives|collectives_server)(?:\.[a-z_][a-z0-9_]*)+)")
PATH = re.compile(
    r"(?<![\w./-])((?:client|server|tests|bench|docs|examples|deploy|docker)/[\w./-]*\w)"
)
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(p for d in ("client", "server", "tests", "bench") for p in (ROOT / d).rglob("*.py")),
]


def _module_exists(dotted: str) -> bool:
    """``dotted`` is a module or package, or an attribute of one (its prefix is)."""
    parts = dotted.split(".")
    base = PACKAGES[parts[0]]
    for n in range(len(parts), 0, -1):
        path = base.joinpath(*parts[:n])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return n >= len(parts) - 1  # the module, or one attribute of it
    return False


def _path_exists(path: str) -> bool:
    path = path.rstrip(".")
    if any(ch in path for ch in "*{<") or path.endswith(("_", "-")) or "NAME" in path:
        return True  # a pattern, not a path
    return (ROOT / path).exists()


def _prose(source: Path) -> list[tuple[int, str]]:
    """The lines a reader reads: all of a markdown file; a module's docstrings and
    comments (string literals in code are data: tensor names look like paths)."""
    text = source.read_text(errors="replace")
    if source.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    lines = text.splitlines()
    prose: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                prose += [(n, lines[n - 1]) for n in range(value.lineno, value.end_lineno + 1)]
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            prose.append((token.start[0], token.string))
    return prose


def _references(source: Path) -> list[tuple[int, str, bool]]:
    found = []
    for number, line in _prose(source):
        found += [(number, m, _module_exists(m)) for m in DOTTED.findall(line)]
        found += [(number, m, _path_exists(m)) for m in PATH.findall(line)]
    return found


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_module_and_path_exists(source: Path) -> None:
    missing = [f"line {n}: {ref}" for n, ref, ok in _references(source) if not ok]
    assert not missing, f"{source.relative_to(ROOT)} names what does not exist: {missing}"
