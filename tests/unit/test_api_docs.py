"""``docs/api.md`` and the docstrings say what the code does, so they cannot drift.

* Every public method of ``Cluster`` and ``DataParallel`` is listed in
  docs/api.md (a heading or a table row's first cell holding ``name(params)``),
  with the parameter names, kinds and defaults of ``inspect.signature``; every
  such listing there matches; every public property has a table row.
* Every public method of ``Cluster``, ``DataParallel``, ``Work`` and ``Group``
  has a Google-style docstring: ``Args:`` naming exactly the parameters (each
  one with a default says ``Defaults to ``X``.`` with that default),
  ``Returns:`` when it returns something, ``Raises:`` unless it raises nothing.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import collectives
from collectives import DataParallel
from collectives.groups import Group
from collectives.work import Work

ROOT = Path(__file__).resolve().parents[2]
API_MD = ROOT / "docs" / "api.md"

# How docs/api.md spells a method whose name is not how it is called.
DOC_NAMES = {(DataParallel, "__call__"): "dp"}
# Calls that raise nothing (views of what the client already holds).
RAISE_NOTHING = {
    (collectives.Cluster, "workers"),
    (collectives.Cluster, "snapshot"),
    (collectives.Cluster, "history"),
    (collectives.Cluster, "close"),
    (Work, "done"),
    (Work, "is_completed"),
}
EMPTY = inspect.Parameter.empty


def public_methods(cls: type) -> list[str]:
    names = []
    for name, member in vars(cls).items():
        if isinstance(member, property) or not callable(member):
            continue
        if not name.startswith("_") or name == "__call__":
            names.append(name)
    return sorted(names)


def public_properties(cls: type) -> list[str]:
    return sorted(n for n, m in vars(cls).items() if isinstance(m, property) and n[0] != "_")


# ------------------------------------------------------------------ parameters
Param = tuple[str, str, object]  # (kind, name, default): kind "pos", "kw", "*" or "**"


def signature_params(fn: object) -> list[Param]:
    kinds = {
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
        inspect.Parameter.KEYWORD_ONLY: "kw",
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.VAR_KEYWORD: "**",
    }
    params = list(inspect.signature(fn).parameters.values())[1:]  # after self
    return [(kinds[p.kind], p.name, p.default) for p in params]


def listed_params(name: str, params_text: str) -> list[Param] | None:
    """The parameters of a documented ``name(params_text)``; None if not a signature."""
    try:
        tree = ast.parse(f"def {name}({params_text}): pass")
    except SyntaxError:
        return None
    args = tree.body[0].args  # type: ignore[attr-defined]
    out: list[Param] = []
    defaults = [EMPTY] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(args.args, defaults, strict=True):
        out.append(("pos", arg.arg, _literal(default)))
    if args.vararg is not None:
        out.append(("*", args.vararg.arg, EMPTY))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append(("kw", arg.arg, _literal(default)))
    if args.kwarg is not None:
        out.append(("**", args.kwarg.arg, EMPTY))
    return out


def _literal(node: ast.expr | object | None) -> object:
    if node is None or node is EMPTY:
        return EMPTY
    return ast.literal_eval(node)  # type: ignore[arg-type]


def same(a: list[Param], b: list[Param]) -> bool:
    """Equal, also in the defaults' types (``0`` is not ``False``)."""
    return [(k, n, repr(d)) for k, n, d in a] == [(k, n, repr(d)) for k, n, d in b]


# ------------------------------------------------------------------ docs/api.md
_HEADING = re.compile(r"^#+\s+`([^`]+)`")
_ROW = re.compile(r"^\|\s*`([^`]+)`")
_CALL = re.compile(r"^([A-Za-z_]\w*)\((.*)\)(\s*->.*)?$")


def doc_listings(text: str) -> dict[str, list[str]]:
    """``name`` -> the ``params`` of every heading or first table cell ``name(params)``."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _HEADING.match(line) or _ROW.match(line)
        if m is None:
            continue
        call = _CALL.match(m.group(1))
        if call is not None:
            found.setdefault(call.group(1), []).append(call.group(2))
    return found


def doc_rows(text: str) -> set[str]:
    return {m.group(1) for line in text.splitlines() if (m := _ROW.match(line))}


def listing_errors(cls: type, text: str) -> list[str]:
    listings = doc_listings(text)
    errors = []
    for method in public_methods(cls):
        shown = DOC_NAMES.get((cls, method), method)
        want = signature_params(getattr(cls, method))
        listed = listings.get(shown, [])
        if not listed:
            errors.append(f"{cls.__name__}.{method}: not listed in docs/api.md as {shown}(...)")
        for params_text in listed:
            got = listed_params(shown, params_text)
            if got is None or not same(got, want):
                errors.append(f"docs/api.md: {shown}({params_text}) is not the signature {want}")
    rows = doc_rows(text)
    errors += [
        f"{cls.__name__}.{p}: no table row `{p}` in docs/api.md"
        for p in public_properties(cls)
        if p not in rows
    ]
    return errors


@pytest.mark.parametrize("cls", [collectives.Cluster, DataParallel], ids=lambda c: c.__name__)
def test_api_md_lists_every_method_with_its_signature(cls: type) -> None:
    assert listing_errors(cls, API_MD.read_text()) == []


def test_the_public_types_are_exported_and_named_in_api_md() -> None:
    """``collectives.DataParallel`` is what ``data_parallel()`` returns (for isinstance)."""
    import collectives.data_parallel

    assert collectives.DataParallel is collectives.data_parallel.DataParallel
    assert "DataParallel" in collectives.__all__
    assert "`collectives.DataParallel`" in API_MD.read_text()
    returns = inspect.signature(collectives.Cluster.data_parallel).return_annotation
    assert returns in ("DataParallel", DataParallel)


def test_a_changed_default_in_api_md_fails() -> None:
    text = API_MD.read_text()
    assert "`get(name, rank=0, timeout=None, out=None)" in text
    broken = text.replace("`get(name, rank=0, timeout=None, out=None)", "`get(name, rank=1, ...")
    assert listing_errors(collectives.Cluster, broken) != []
    missing = text.replace("`get(name, rank=0, timeout=None, out=None)", "`got()")
    assert "Cluster.get: not listed" in " ".join(listing_errors(collectives.Cluster, missing))


# ------------------------------------------------------------------ docstrings
_SECTION = re.compile(r"^(\s*)(Args|Returns|Raises|Yields|Example|Examples|Note):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}\w+)(\s*\([^)]*\))?:(\s|$)")
_DEFAULT = re.compile(r"Defaults to ``(.+?)``\.")


def docstring_sections(doc: str) -> dict[str, list[str]]:
    """Section name -> its lines (dedented to the section's own indentation + 4)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    indent = 0
    for line in inspect.cleandoc(doc).splitlines():
        m = _SECTION.match(line)
        if m is not None:
            indent = len(m.group(1))
            current = sections.setdefault(m.group(2), [])
            continue
        if current is not None:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                current = None  # back to prose
                continue
            current.append(line[indent + 4 :] if line.strip() else "")
    return sections


def args_entries(lines: list[str]) -> dict[str, str]:
    """Argument name (``*x``/``**x`` for the variadic ones) -> its whole text."""
    entries: dict[str, str] = {}
    name = None
    for line in lines:
        m = _ENTRY.match(line)
        if m is not None and not line.startswith(" "):
            name = m.group(1)
            entries[name] = line[m.end() :].strip()
        elif name is not None and line.strip():
            entries[name] += " " + line.strip()
    return entries


def docstring_errors(cls: type, method: str, doc: str | None = None) -> list[str]:
    fn = getattr(cls, method)
    where = f"{cls.__name__}.{method}"
    doc = fn.__doc__ if doc is None else doc
    if not doc:
        return [f"{where}: no docstring"]
    sections = docstring_sections(doc)
    errors = []
    params = signature_params(fn)
    if params or "Args" in sections:
        entries = args_entries(sections.get("Args", []))
        names = {{"*": "*", "**": "**"}.get(k, "") + n: d for k, n, d in params}
        if set(entries) != set(names):
            errors.append(f"{where}: Args {sorted(entries)} != parameters {sorted(names)}")
        for name, default in names.items():
            if name not in entries or default is EMPTY:
                continue
            said = _DEFAULT.search(entries[name])
            if said is None:
                errors.append(f"{where}: Args {name} does not say 'Defaults to ``{default!r}``.'")
            elif repr(ast.literal_eval(said.group(1))) != repr(default):
                errors.append(f"{where}: Args {name} says default {said.group(1)}, not {default!r}")
    returns = inspect.signature(fn).return_annotation
    if returns not in ("None", None, EMPTY) and "Returns" not in sections:
        errors.append(f"{where}: returns {returns} but has no Returns: section")
    if (cls, method) not in RAISE_NOTHING and "Raises" not in sections:
        errors.append(f"{where}: no Raises: section")
    return errors


_DOCUMENTED = [
    (cls, method)
    for cls in (collectives.Cluster, DataParallel, Work, Group)
    for method in public_methods(cls)
]


@pytest.mark.parametrize(
    ("cls", "method"), _DOCUMENTED, ids=[f"{c.__name__}.{m}" for c, m in _DOCUMENTED]
)
def test_every_public_method_has_args_returns_and_raises(cls: type, method: str) -> None:
    assert docstring_errors(cls, method) == []


def test_a_changed_default_or_argument_in_a_docstring_fails() -> None:
    doc = collectives.Cluster.get.__doc__ or ""
    assert "rank: the global rank to read from. Defaults to ``0``." in doc
    wrong_default = doc.replace("Defaults to ``0``.", "Defaults to ``1``.")
    assert docstring_errors(collectives.Cluster, "get", wrong_default) == [
        "Cluster.get: Args rank says default 1, not 0"
    ]
    renamed = doc.replace("rank: the global rank", "rnk: the global rank")
    assert docstring_errors(collectives.Cluster, "get", renamed) != []
    no_returns = doc.replace("Returns:", "Gives:")
    assert "no Returns: section" in " ".join(
        docstring_errors(collectives.Cluster, "get", no_returns)
    )
