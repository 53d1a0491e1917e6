"""``docs/api.md``'s reference blocks are its docstrings, rendered (``tools/api_reference.py``).

The blocks between ``<!-- api: ... -->`` and ``<!-- /api -->`` are what
``make docs`` writes from the SDK's docstrings; this fails when the file is
stale, when a public method or property of ``Cluster``, ``DataParallel``,
``Work`` or ``Group`` has no block, or when a block names nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import collectives

ROOT = Path(__file__).resolve().parents[2]


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "api_reference", ROOT / "tools" / "api_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("api_reference", module)
    spec.loader.exec_module(module)
    return module


api_reference = _load_generator()


def test_docs_api_md_is_what_make_docs_writes() -> None:
    problems = api_reference.check()
    assert problems == [], "docs/api.md is stale: run make docs\n" + "\n".join(problems)


def test_a_changed_docstring_changes_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    text = api_reference.API_MD.read_text()
    doc = collectives.Cluster.get.__doc__ or ""
    assert "Downloads the tensor stored under ``name``" in doc
    changed = doc.replace("Downloads the tensor", "Fetches the tensor")
    monkeypatch.setattr(collectives.Cluster.get, "__doc__", changed)
    rendered, problems = api_reference.render(text)
    assert problems == []
    assert "Fetches the tensor stored under `name` on `rank`." in rendered
    assert "Fetches the tensor" not in text
    stale = api_reference.check()
    assert len(stale) == 1 and "stale: run make docs" in stale[0]
    assert "+Fetches the tensor" in stale[0] and "-Downloads the tensor" in stale[0]


def test_a_hand_edit_inside_a_block_is_overwritten() -> None:
    text = api_reference.API_MD.read_text()
    assert "### `get(name, rank=0, timeout=None, out=None) -> torch.Tensor`" in text
    broken = text.replace("### `get(name, rank=0,", "### `get(name, rank=1,")
    rendered, _ = api_reference.render(broken)
    assert rendered == text


def test_a_public_method_without_a_block_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    text = api_reference.API_MD.read_text()
    start = text.index("<!-- api: Cluster.delete -->")
    end = text.index("<!-- /api -->", start) + len("<!-- /api -->")
    _, problems = api_reference.render(text[:start] + text[end:])
    assert [p for p in problems if "Cluster.delete" in p] == [
        "Cluster.delete: public call without a block in docs/api.md "
        "(add <!-- api: Cluster.delete --> ... <!-- /api -->)"
    ]

    def rebalance(self: collectives.Cluster, timeout: float | None = None) -> None:
        """Rebalances the cluster."""

    monkeypatch.setattr(collectives.Cluster, "rebalance", rebalance, raising=False)
    _, problems = api_reference.render(text)
    assert any(p.startswith("Cluster.rebalance: public call without a block") for p in problems)


def test_a_property_without_a_table_is_reported() -> None:
    text = api_reference.API_MD.read_text()
    start = text.index("<!-- api-properties: Work -->")
    end = text.index("<!-- /api -->", start) + len("<!-- /api -->")
    _, problems = api_reference.render(text[:start] + text[end:])
    assert any(p.startswith("Work.generation: public property without a block") for p in problems)


def test_a_block_naming_nothing_or_twice_is_reported() -> None:
    text = api_reference.API_MD.read_text()
    for bad in ("Cluster.no_such_call", "NoSuchClass.put", "collectives.no_such_function"):
        _, problems = api_reference.render(text + f"\n<!-- api: {bad} -->\n<!-- /api -->\n")
        assert any(bad.split(".")[-1] in p and "does not exist" in p for p in problems), problems
    _, problems = api_reference.render(text + "\n<!-- api: Cluster.put -->\n<!-- /api -->\n")
    assert any("Cluster.put already has a block" in p for p in problems)
    _, problems = api_reference.render(text + "\n<!-- api: Cluster.put -->\nno end\n")
    assert any("has no <!-- /api -->" in p for p in problems)


def test_docstring_markup_becomes_markdown() -> None:
    doc = """Does ``x`` via :meth:`put`, :class:`~collectives.work.Work` and :func:`connect`.

    Example::

        cluster.put("x", t)

    Args:
        name: the name (``a | b``). Defaults to ``None``.

    Returns:
        A :attr:`thing`.

    Raises:
        NotFound: it is missing
            on every rank.
    """
    assert api_reference.markdown(doc) == [
        "Does `x` via `put`, `Work` and `connect`.",
        "",
        "**Example:**",
        "",
        "```python",
        'cluster.put("x", t)',
        "```",
        "",
        "**Args:**",
        "",
        "| argument | description |",
        "| --- | --- |",
        "| `name` | the name (`a \\| b`). Defaults to `None`. |",
        "",
        "**Returns:** A `thing`.",
        "",
        "**Raises:**",
        "",
        "| exception | when |",
        "| --- | --- |",
        "| `NotFound` | it is missing on every rank. |",
    ]
