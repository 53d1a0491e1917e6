"""``docs/flags.md`` is generated from the daemons' declared settings and kept current."""

from __future__ import annotations

import re
from pathlib import Path

from collectives_server.cli.reference import render
from collectives_server.coordinator.daemon import CoordinatorConfig
from collectives_server.settings import flag_rows
from collectives_server.worker.config import WorkerConfig

FLAGS_MD = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def test_docs_flags_md_is_what_make_docs_writes() -> None:
    assert FLAGS_MD.read_text() == render(), "docs/flags.md is stale: run `make docs`"


def test_the_reference_names_every_declared_setting() -> None:
    text = render()
    for cls in (CoordinatorConfig, WorkerConfig):
        for flags, _default, _help in flag_rows(cls):
            assert flags.split(" / ")[0] in text


def _declared_defaults() -> dict[str, str]:
    defaults = {}
    for cls in (CoordinatorConfig, WorkerConfig):
        for flags, default, _help in flag_rows(cls):
            for flag in flags.split(" / "):
                defaults[flag] = default
    return defaults


def _numeric(text: str) -> str:
    """``300 s`` / ``2 GiB`` / ``256 (backlog 1024)`` → ``300`` / ``2GiB`` / ``256``."""
    match = re.match(r"([0-9.]+)\s*([KMGT]i?B)?", text.strip())
    assert match, text
    return match.group(1) + (match.group(2) or "")


def test_the_bounds_tables_state_the_declared_defaults() -> None:
    """README's and security.md's bound tables say what beyond each bound answers; the
    defaults they quote are the declared ones."""
    declared = _declared_defaults()
    quoted: list[tuple[str, str, str]] = []
    security = (FLAGS_MD.parent / "security.md").read_text()
    for flag, default in re.findall(r"\| `(--[a-z0-9-]+)` \| ([0-9][^|]*) \|", security):
        quoted.append(("docs/security.md", flag, _numeric(default)))
    readme = (FLAGS_MD.parents[1] / "README.md").read_text()
    table = readme[readme.index("| where | bounds (flag default) |") :].split("\n\n")[0]
    for flag, default in re.findall(r"`(--[a-z0-9-]+) ([0-9][^`]*)`", table):
        quoted.append(("README.md", flag, default))
    assert len(quoted) > 30
    for where, flag, default in quoted:
        if declared[flag][:1].isdigit():
            said = f"{where}: {flag} {default}"
            assert default == declared[flag], f"{said} (declared: {declared[flag]})"
