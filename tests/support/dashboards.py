"""The committed Grafana dashboards as JSON, and the metric selectors of their PromQL
(tests/operations/test_dashboards.py checks them, tests/core/test_e2e_prometheus.py runs them)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
FILES = sorted(DASHBOARD_DIR.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and panels inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) of every query."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel.get("title", ""), target["expr"]


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$\{?\w+(?::\w+)?\}?|\[\[\w+\]\]")
_SELECTOR = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"\"")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless",
             "inf", "nan"}


def selectors(expr: str) -> list[tuple[str, list[str]]]:
    """(metric name, label names matched) of every vector selector in ``expr``.

    Strings and Grafana variables are blanked first; functions and aggregations (identifiers followed
    by ``(``), keywords, grouping label lists, ranges and numbers are not metrics. Raises ValueError
    for a selector without a metric name (``{__name__=...}``), which this test cannot check.
    """
    text = _STRING.sub('""', expr)
    text = _VARIABLE.sub("1", text)
    found: list[tuple[str, list[str]]] = []

    def selector(m: re.Match[str]) -> str:
        if not m.group(1):
            raise ValueError(f"selector without a metric name in {expr!r}")
        found.append((m.group(1), _MATCHER.findall(m.group(2))))
        return " "

    text = _SELECTOR.sub(selector, text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    found += [(name, []) for name in _IDENT.findall(text) if name not in _KEYWORDS]
    return found
