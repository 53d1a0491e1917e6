"""What the Grafana dashboard in docker/ queries: metric names and label names.

Shared by the static check (tests/unit/test_docker_config.py), the live one
(tests/integration/test_grafana_metrics.py), which compares them with what the
daemons' /metrics endpoints export, and the real one
(tests/integration/test_prometheus_real.py), which has a real Prometheus evaluate
every query after :func:`render` substituted the Grafana variables as Grafana would.

PromQL is not parsed in full; the dashboard's expressions are simple enough that
removing strings, label matchers, range selectors and grouping clauses leaves
only function names (followed by ``(``), keywords, numbers and metric names.
Names are kept as written, suffix and all (``..._total``, ``..._bucket``): the
live check compares them with the *sample* names of the exposition, which carry
the same suffixes, so a query of ``collectives_ops`` (the family name, which
Prometheus never stores) fails as it would in Grafana.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DASHBOARD", "Query", "all_values", "dashboard_queries", "label_values", "parse_expr",
    "render",
]  # fmt: skip

DASHBOARD = Path(__file__).resolve().parents[1] / "docker/grafana/dashboards/collectives.json"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", re.IGNORECASE
)
# Not preceded by a digit: the "m" of "5m" and the "e3" of "1e3" are no names.
_IDENT = re.compile(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(\w+)\s*\)\s*$")
# Grafana's variable syntaxes: ${name} (${name:format} is not supported here),
# [[name]] (deprecated), $name; built-ins such as $__rate_interval are names too.
_VARIABLE = re.compile(r"\$\{(\w+)(:[^}]*)?\}|\[\[(\w+)(:\w+)?\]\]|\$(\w+)")
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "atan2", "inf", "nan", "start", "end",
}  # fmt: skip
# Added by Prometheus at scrape time, or part of every histogram bucket.
IMPLICIT_LABELS = {"instance", "job", "role", "le"}


@dataclass(frozen=True)
class Query:
    where: str  # panel title and refId, for messages
    expr: str
    metrics: frozenset[str] = field(default_factory=frozenset)
    labels: frozenset[str] = field(default_factory=frozenset)
    variable: str | None = None  # the template variable this query fills, if any


def parse_expr(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) used by one PromQL expression (or label_values())."""
    lv = label_values(expr)
    if lv:
        return {lv[0]}, {lv[1]}
    labels: set[str] = set()
    text = _STRING.sub('""', expr)
    for body in _MATCHERS.findall(text):
        labels.update(_MATCHER_LABEL.findall(body))
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    for _, body in _GROUPING.findall(text):
        labels.update(name.strip() for name in body.split(",") if name.strip())
    text = _GROUPING.sub(" ", text)
    metrics = set()
    for match in _IDENT.finditer(text):
        name = match.group(0)
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or name.lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        metrics.add(name)
    return metrics, labels


def label_values(expr: str) -> tuple[str, str] | None:
    """(metric, label) of a ``label_values(metric, label)`` variable query, else None."""
    match = _LABEL_VALUES.match(expr)
    return (match.group(1), match.group(2)) if match else None


def render(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with every Grafana variable replaced by its value in ``values``.

    Raises KeyError naming a variable ``values`` lacks, and ValueError for a
    ``${name:format}`` (formats are not implemented), so no query reaches
    Prometheus with a ``$`` left in it.
    """

    def value(match: re.Match[str]) -> str:
        if match.group(2) or match.group(4):
            raise ValueError(f"variable format {match.group(0)!r} in {expr!r}: not supported")
        name = match.group(1) or match.group(3) or match.group(5)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(value, expr)


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows hold their panels


def dashboard_queries(path: Path = DASHBOARD) -> list[Query]:
    """Every query of the dashboard: panel targets and template variables."""
    dashboard = json.loads(path.read_text())
    queries = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            metrics, labels = parse_expr(expr)
            where = f"panel {panel.get('title')!r} target {target.get('refId')}"
            queries.append(Query(where, expr, frozenset(metrics), frozenset(labels)))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        expr = query.get("query", "") if isinstance(query, dict) else str(query or "")
        metrics, labels = parse_expr(expr)
        where = f"variable ${var.get('name')}"
        queries.append(
            Query(where, expr, frozenset(metrics), frozenset(labels), variable=var.get("name"))
        )
    return queries


def all_values(path: Path = DASHBOARD) -> dict[str, str]:
    """Each template variable's value when "All" is selected (its ``allValue``)."""
    dashboard = json.loads(path.read_text())
    return {
        var["name"]: var["allValue"]
        for var in dashboard.get("templating", {}).get("list", [])
        if var.get("includeAll") and var.get("allValue") is not None
    }
