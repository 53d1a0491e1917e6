"""Renders the API reference blocks of ``docs/api.md`` from the SDK's docstrings.

``docs/api.md`` is a hand-written guide except between markers, which this
script fills from the objects they name (``import collectives``), so each
public call's text is written once, in its docstring::

    <!-- api: Cluster.put -->            a function or method: a heading holding
    ...                                  `put(params) -> return`, then its docstring
    <!-- /api -->                        in Markdown (Args, Returns, Raises tables)

    <!-- api: Group.group_rank h4 -->    the same under a level-4 heading (h1..h6; default h3)
    <!-- api-properties: Cluster -->     a table of the class's public properties
    ...
    <!-- /api -->

Names resolve in ``collectives`` (``Cluster.put`` is ``collectives.Cluster.put``;
``collectives.connect`` is the function). ``python tools/api_reference.py``
rewrites the blocks in place (``make docs``); ``--check`` changes nothing and
exits 1, with a unified diff on stderr, when the file would change. Both fail
when a block names nothing that exists, or when a public method or property of
``Cluster``, ``DataParallel``, ``Work`` or ``Group`` (or ``collectives.connect``)
has no block: a new call cannot be left out of the reference.
``tests/unit/test_api_reference.py`` runs the check.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import collectives

ROOT = Path(__file__).resolve().parents[1]
API_MD = ROOT / "docs" / "api.md"

# Every public method and property of these classes, and these functions, need a block.
DOCUMENTED_CLASSES = ("Cluster", "DataParallel", "Work", "Group")
DOCUMENTED_FUNCTIONS = ("collectives.connect",)
# How the reference spells a call whose name is not how it is called.
SHOWN_NAMES = {"DataParallel.__call__": "dp"}

END = "<!-- /api -->"
_START = re.compile(
    r"^<!-- api(?P<table>-properties)?: (?P<target>[A-Za-z_][\w.]*)(?: h(?P<level>[1-6]))? -->$"
)
_ANY_MARKER = re.compile(r"^<!-- /?api\b")

# Google-style docstring sections (a line of its own, not indented).
_SECTION = re.compile(
    r"^(?P<name>Args|Arguments|Returns|Raises|Yields|Example|Examples|Note|Notes):\s*$"
)
_ENTRY = re.compile(r"^(?P<name>\*{0,2}\w+)(?:\s*\([^)]*\))?:(?:\s+(?P<text>.*))?$")
_ROLE = re.compile(
    r":(?:meth|func|class|attr|mod|obj|data|exc|const):`(?P<tilde>~?)(?P<ref>[^`]+)`"
)
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


# ------------------------------------------------------------------ the objects
def public_methods(cls: type) -> list[str]:
    """The methods a user calls: not ``_``-prefixed (``__call__`` is public)."""
    names = []
    for name, member in vars(cls).items():
        if isinstance(member, property) or not callable(member):
            continue
        if not name.startswith("_") or name == "__call__":
            names.append(name)
    return sorted(names)


def public_properties(cls: type) -> list[str]:
    return sorted(n for n, m in vars(cls).items() if isinstance(m, property) and n[0] != "_")


def required_targets() -> list[str]:
    """Every name that must have a block: ``Cluster.put``, ``collectives.connect``, ..."""
    targets = list(DOCUMENTED_FUNCTIONS)
    for class_name in DOCUMENTED_CLASSES:
        cls = getattr(collectives, class_name)
        targets += [f"{class_name}.{m}" for m in public_methods(cls)]
        targets += [f"{class_name}.{p}" for p in public_properties(cls)]
    return targets


@dataclass(frozen=True)
class Target:
    name: str  # as the marker spells it: "Cluster.put", "collectives.connect"
    obj: Any
    owner: type | None  # the class of a method, None for a function


def resolve(name: str) -> Target:
    """The object ``name`` spells, looked up in ``collectives``.

    Raises:
        LookupError: nothing of that name, or not a function, method or class.
    """
    parts = name.split(".")
    if parts[0] == "collectives":
        parts = parts[1:]
    obj: Any = collectives
    owner: type | None = None
    for i, part in enumerate(parts):
        where = vars(obj) if isinstance(obj, type) else None
        if where is not None and part in where:
            owner, obj = obj, where[part]  # the class's own attribute, not an inherited one
        elif where is None and hasattr(obj, part):
            owner, obj = None, getattr(obj, part)
        else:
            raise LookupError(f"{name}: {'.'.join(parts[: i + 1])} does not exist")
    if not (callable(obj) or isinstance(obj, property)) or not parts:
        raise LookupError(f"{name}: not a function, method, property or class")
    return Target(name, obj, owner)


# ------------------------------------------------------------------ signatures
def format_signature(target: Target) -> str:
    """``name(params) -> return``: parameters as ``inspect.signature`` has them (``self``
    dropped, defaults as ``repr``), annotations of parameters left out, the return
    annotation as written."""
    fn = target.obj
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if target.owner is not None and not isinstance(
        inspect.getattr_static(target.owner, target.name.rsplit(".", 1)[1]), staticmethod
    ):
        params = params[1:]  # self (or cls)
    parts: list[str] = []
    star = False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}")
        following = params[i + 1] if i + 1 < len(params) else None
        if p.kind is p.POSITIONAL_ONLY and (following is None or following.kind is not p.kind):
            parts.append("/")
    returns = sig.return_annotation
    if returns is sig.empty:
        arrow = ""
    elif isinstance(returns, str):
        arrow = f" -> {returns}"
    else:
        arrow = f" -> {inspect.formatannotation(returns)}"
    return f"{shown_name(target.name)}({', '.join(parts)}){arrow}"


def canonical(name: str) -> str:
    """``Cluster.put`` for ``collectives.Cluster.put``; ``collectives.connect`` for ``connect``."""
    parts = name.split(".")
    if parts[0] == "collectives":
        parts = parts[1:]
    return ".".join(parts) if len(parts) > 1 else f"collectives.{parts[0]}"


def shown_name(name: str) -> str:
    """The name a heading shows: ``put``, ``dp``, ``collectives.connect``."""
    name = canonical(name)
    if name in SHOWN_NAMES:
        return SHOWN_NAMES[name]
    if name.startswith("collectives."):
        return name  # a function of the package
    return name.rsplit(".", 1)[-1]


# ------------------------------------------------------------------ docstrings
def inline(text: str) -> str:
    """reST inline markup to Markdown: ````x```` and ``:meth:`x``` become ```x```."""
    text = _ROLE.sub(lambda m: f"`{m['ref'].rsplit('.', 1)[-1] if m['tilde'] else m['ref']}`", text)
    return _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def prose(lines: list[str]) -> list[str]:
    """Docstring prose to Markdown lines: paragraphs (and lists) as they are, with
    inline markup converted; a paragraph ending in ``::`` introduces a literal
    block, which becomes a fenced ``python`` block."""
    out: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            out.extend(inline("\n".join(paragraph)).split("\n"))
            paragraph.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            flush()
            out.append("")
            i += 1
            continue
        if not line.rstrip().endswith("::"):
            paragraph.append(line)
            i += 1
            continue
        # "text::" then an indented literal block: "text:" and a fence ("Example::"
        # alone: "Example:"; "text ::": "text").
        base = _indent(line)
        head = line.rstrip()[:-2]
        if not paragraph and _SECTION.match(head.strip() + ":"):
            paragraph.append(f"**{head.strip()}:**")  # "Example::" as a section's title
        else:
            paragraph.append(head.rstrip() if head.endswith(" ") else head + ":")
        flush()
        i += 1
        code: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            code.append(lines[i])
            i += 1
        code = _trim(code)
        out += ["", "```python", *textwrap.dedent("\n".join(code)).split("\n"), "```", ""]
    flush()
    return _squeeze(out)


def _trim(lines: list[str]) -> list[str]:
    """No leading or trailing blank lines; no trailing spaces."""
    lines = [line.rstrip() for line in lines]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _squeeze(lines: list[str]) -> list[str]:
    """No leading, trailing or doubled blank lines outside fenced code."""
    out: list[str] = []
    fenced = False
    for line in _trim(lines):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or line or out[-1]:
            out.append(line)
    return out


@dataclass
class Docstring:
    """A Google-style docstring cut into prose and sections, in the order written."""

    parts: list[tuple[str, list[str]]]  # ("prose" or the section's name, its lines)

    @classmethod
    def parse(cls, doc: str | None) -> Docstring:
        lines = inspect.cleandoc(doc or "").splitlines()
        parts: list[tuple[str, list[str]]] = []
        i = 0
        while i < len(lines):
            m = _SECTION.match(lines[i])
            if m is None:
                if not parts or parts[-1][0] != "prose":
                    parts.append(("prose", []))
                parts[-1][1].append(lines[i])
                i += 1
                continue
            i += 1
            body: list[str] = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > 0):
                body.append(lines[i])
                i += 1
            parts.append((m["name"], textwrap.dedent("\n".join(body)).split("\n")))
        return cls(parts)


def entries(lines: list[str]) -> list[tuple[str, str]]:
    """``name: text`` entries of an Args or Raises section (continuations joined)."""
    found: list[tuple[str, str]] = []
    for line in lines:
        m = _ENTRY.match(line) if not line.startswith(" ") else None
        if m is not None:
            found.append((m["name"], m["text"] or ""))
        elif found and line.strip():
            name, text = found[-1]
            found[-1] = (name, f"{text} {line.strip()}".strip())
    return found


def cell(text: str) -> str:
    """One table cell: on one line, ``|`` escaped."""
    return inline(" ".join(text.split())).replace("|", "\\|")


def table(header: tuple[str, str], rows: list[tuple[str, str]]) -> list[str]:
    out = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    out += [f"| `{name}` | {cell(text)} |" for name, text in rows]
    return out


def markdown(doc: str | None) -> list[str]:
    """A docstring's Markdown: prose, then each section as written."""
    out: list[str] = []
    for kind, lines in Docstring.parse(doc).parts:
        if kind == "prose":
            body = prose(lines)
        elif kind in ("Args", "Arguments"):
            body = ["**Args:**", "", *table(("argument", "description"), entries(lines))]
        elif kind == "Raises":
            body = ["**Raises:**", "", *table(("exception", "when"), entries(lines))]
        elif kind in ("Returns", "Yields"):
            text = prose(lines)
            body = [f"**{kind}:** {text[0]}", *text[1:]] if text else []
        elif kind in ("Example", "Examples"):
            code = _trim(lines)
            if any(line.rstrip().endswith("::") for line in code):
                body = [f"**{kind}:**", "", *prose(code)]
            else:
                body = [f"**{kind}:**", "", "```python", *code, "```"]
        else:  # Note, Notes
            text = prose(lines)
            body = [f"**{kind}:** {text[0]}", *text[1:]] if text else []
        if body:
            out += ["", *body] if out else body
    return out


def one_line(doc: str | None) -> str:
    """A property's docstring for a table row: prose and sections on one line."""
    said: list[str] = []
    for kind, lines in Docstring.parse(doc).parts:
        if kind == "prose":
            said.append(" ".join(" ".join(lines).split()))
        elif kind == "Raises":
            said += [f"Raises `{name}`: {' '.join(text.split())}" for name, text in entries(lines)]
        else:
            said.append(f"{kind}: {' '.join(' '.join(lines).split())}")
    return " ".join(s for s in said if s)


# ------------------------------------------------------------------ blocks
def render_block(target: str, level: int) -> list[str]:
    """The lines of ``<!-- api: target -->``'s block (between the markers)."""
    found = resolve(target)
    if isinstance(found.obj, (property, type)):
        raise LookupError(
            f"{target}: a class or property; an api block documents a function or method "
            "(properties: <!-- api-properties: Class -->)"
        )
    return [f"{'#' * level} `{format_signature(found)}`", "", *markdown(inspect.getdoc(found.obj))]


def render_properties(class_name: str) -> tuple[list[str], list[str]]:
    """``<!-- api-properties: class_name -->``'s table, and the names it covers."""
    cls = resolve(class_name).obj
    if not isinstance(cls, type):
        raise LookupError(f"{class_name}: api-properties names a class")
    names = [n for n, m in vars(cls).items() if isinstance(m, property) and n[0] != "_"]
    if not names:
        raise LookupError(f"{class_name}: has no public property")
    rows = [(n, one_line(inspect.getdoc(vars(cls)[n]))) for n in names]
    prefix = canonical(class_name).removeprefix("collectives.")
    return table(("property", "what"), rows), [f"{prefix}.{n}" for n in names]


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every block rendered, and the problems found (a block naming
    nothing, an unclosed block, a required name without a block)."""
    lines = text.split("\n")
    out: list[str] = []
    problems: list[str] = []
    covered: dict[str, int] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        start = _START.match(line)
        if start is None:
            if _ANY_MARKER.match(line):
                problems.append(f"docs/api.md:{i + 1}: a marker out of place: {line}")
            out.append(line)
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end] != END and not _ANY_MARKER.match(lines[end]):
            end += 1
        if end == len(lines) or lines[end] != END:
            problems.append(f"docs/api.md:{i + 1}: {line} has no {END} before the next marker")
            out += lines[i:end]
            i = end
            continue
        target = start["target"]
        try:
            if start["table"]:
                body, names = render_properties(target)
            else:
                body = render_block(target, int(start["level"] or 3))
                names = [canonical(target)]
        except LookupError as err:
            problems.append(f"docs/api.md:{i + 1}: {err}")
            out += lines[i : end + 1]
        else:
            out += [line, *body, "", END]
            for name in names:
                if name in covered:
                    problems.append(
                        f"docs/api.md:{i + 1}: {name} already has a block (line {covered[name]})"
                    )
                covered.setdefault(name, i + 1)
        i = end + 1
    for name in required_targets():
        if name not in covered:
            what = "property" if isinstance(resolve(name).obj, property) else "call"
            hint = (
                f"<!-- api-properties: {name.rsplit('.', 1)[0]} -->"
                if what == "property"
                else f"<!-- api: {name} -->"
            )
            problems.append(
                f"{name}: public {what} without a block in docs/api.md (add {hint} ... {END})"
            )
    return "\n".join(out), problems


# ------------------------------------------------------------------ entry points
def check(path: Path = API_MD) -> list[str]:
    """What is wrong with ``path``: its problems, and a unified diff when it is stale."""
    text = path.read_text(encoding="utf-8")
    rendered, problems = render(text)
    if rendered != text:
        diff = difflib.unified_diff(
            text.splitlines(keepends=True),
            rendered.splitlines(keepends=True),
            fromfile=f"{path.name} (as committed)",
            tofile=f"{path.name} (from the docstrings)",
        )
        problems.append(
            f"{path.name} is stale: run make docs (or python tools/api_reference.py)\n"
            + "".join(diff)
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if docs/api.md is stale"
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    text = API_MD.read_text(encoding="utf-8")
    rendered, problems = render(text)
    if rendered != text:
        API_MD.write_text(rendered, encoding="utf-8")
        print(f"{API_MD.relative_to(ROOT)}: reference blocks rewritten from the docstrings")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
