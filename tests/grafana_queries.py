"""What the Grafana dashboard in docker/ queries: metric names and label names.

Shared by the static check (tests/unit/test_docker_config.py) and the live one
(tests/integration/test_grafana_metrics.py), which compares them with what the
daemons' /metrics endpoints export.

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DASHBOARD", "Query", "dashboard_queries", "parse_expr"]

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


def parse_expr(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) used by one PromQL expression (or label_values())."""
    lv = _LABEL_VALUES.match(expr)
    if lv:
        return {lv.group(1)}, {lv.group(2)}
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
        queries.append(Query(where, expr, frozenset(metrics), frozenset(labels)))
    return queries
