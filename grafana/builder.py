"""Small builders for Grafana dashboard JSON (dashboard schema version 39: Grafana 10.4 and later).

``generate.py`` describes each dashboard as rows of :class:`Panel` objects; :func:`dashboard` lays
them out on Grafana's 24-column grid and returns the JSON model that Grafana's "Export" would give:
panel ids numbered from 1, every panel and query on the Prometheus datasource chosen by the
``$datasource`` variable. Standard library only, so regenerating needs nothing installed.

Field names follow Grafana's dashboard JSON model (``docs/sources/dashboards/build-dashboards/
view-dashboard-json-model`` in grafana/grafana): ``gridPos``, ``fieldConfig.defaults.unit``,
``targets[].expr``/``legendFormat``/``instant``/``format``, ``templating.list``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel; ``legend`` is Grafana's legend format (``{{label}}``)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """One visualisation. ``unit`` is a Grafana unit id (``bytes``, ``percentunit``, ``watt``, ...).

    ``kind``: ``timeseries``, ``stat``, ``table``, ``bargauge``, ``state-timeline`` or ``piechart``;
    tables, stats, bar gauges and pie charts run instant queries, the others range queries.
    ``mappings`` are Grafana value mappings ({value: (text, colour)}); ``red_from`` colours values at
    or above it red (stat and bar gauge backgrounds, table cells); ``columns`` renames table value
    columns per query ({"Value #A": "Processes"}) and ``column_units`` gives them units.
    """

    title: str
    description: str
    unit: str
    queries: Sequence[Query]
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    mappings: dict[int, tuple[str, str]] = field(default_factory=dict)
    red_from: float | None = None
    columns: dict[str, str] = field(default_factory=dict)
    column_units: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """A titled row of panels."""

    title: str
    panels: Sequence[Panel]


INSTANT_KINDS = frozenset({"table", "stat", "bargauge", "piechart"})


def datasource_variable() -> dict[str, Any]:
    """The ``datasource`` variable: any Prometheus datasource."""
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
            "regex": "", "skipUrlSync": False}


def query_variable(name: str, label: str, query: str, *, multi: bool = True) -> dict[str, Any]:
    """A variable filled by ``label_values(...)`` on the chosen datasource, with "All" = ``.*``
    (matches the empty value too, so series without the label are kept)."""
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE, "definition": query,
            "query": query, "current": {}, "hide": 0, "includeAll": True, "allValue": ".*", "multi": multi,
            "options": [], "refresh": 2, "regex": "", "skipUrlSync": False, "sort": 1}


def custom_variable(name: str, label: str, values: Sequence[str]) -> dict[str, Any]:
    """A variable with fixed choices; the first is the default."""
    return {"name": name, "label": label, "type": "custom", "query": ",".join(values),
            "current": {"selected": True, "text": values[0], "value": values[0]}, "hide": 0,
            "includeAll": False, "multi": False, "skipUrlSync": False,
            "options": [{"selected": i == 0, "text": v, "value": v} for i, v in enumerate(values)]}


def _thresholds(red_from: float | None) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if red_from is not None:
        steps.append({"color": "red", "value": red_from})
    return {"mode": "absolute", "steps": steps}


def _mappings(mappings: dict[int, tuple[str, str]]) -> list[dict[str, Any]]:
    if not mappings:
        return []
    options = {str(v): {"text": text, "color": colour, "index": i}
               for i, (v, (text, colour)) in enumerate(sorted(mappings.items()))}
    return [{"type": "value", "options": options}]


def _custom(kind: str) -> dict[str, Any]:
    if kind == "timeseries":
        return {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                "spanNulls": False, "axisPlacement": "auto"}
    if kind == "state-timeline":
        return {"fillOpacity": 80, "lineWidth": 0}
    if kind == "table":
        return {"align": "auto", "cellOptions": {"type": "color-text"}, "inspect": False}
    return {}


def _options(kind: str) -> dict[str, Any]:
    legend = {"displayMode": "list", "placement": "bottom", "showLegend": True}
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if kind == "timeseries":
        return {"legend": legend, "tooltip": {"mode": "multi", "sort": "desc"}}
    if kind == "state-timeline":
        return {"legend": legend, "tooltip": {"mode": "single", "sort": "none"}, "showValue": "auto",
                "mergeValues": True, "rowHeight": 0.9, "alignValue": "left"}
    if kind == "stat":
        return {"reduceOptions": reduce, "colorMode": "background", "graphMode": "none", "justifyMode": "auto",
                "orientation": "auto", "textMode": "auto"}
    if kind == "bargauge":
        return {"reduceOptions": reduce, "displayMode": "gradient", "orientation": "horizontal",
                "showUnfilled": True, "valueMode": "color", "namePlacement": "auto", "sizing": "auto"}
    if kind == "piechart":
        return {"reduceOptions": reduce, "pieType": "pie", "legend": {**legend, "placement": "right"},
                "displayLabels": ["name", "value"], "tooltip": {"mode": "single", "sort": "none"}}
    if kind == "table":
        return {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]}}
    raise ValueError(f"unknown panel kind {kind!r}")


def _table_transformations(panel: Panel) -> list[dict[str, Any]]:
    hidden = {"Time": True, "__name__": True, "job": True}
    steps: list[dict[str, Any]] = []
    if len(panel.queries) > 1:
        steps.append({"id": "merge", "options": {}})
    steps.append({"id": "organize", "options": {"excludeByName": hidden, "renameByName": dict(panel.columns),
                                                 "indexByName": {}}})
    return steps


def _overrides(panel: Panel) -> list[dict[str, Any]]:
    return [{"matcher": {"id": "byName", "options": panel.columns.get(col, col)},
             "properties": [{"id": "unit", "value": unit}]} for col, unit in panel.column_units.items()]


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    instant = panel.kind in INSTANT_KINDS
    targets = []
    for i, q in enumerate(panel.queries):
        target: dict[str, Any] = {"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": q.expr,
                                  "legendFormat": q.legend or "__auto", "range": not instant, "instant": instant}
        if panel.kind == "table":
            target["format"] = "table"
        targets.append(target)
    defaults: dict[str, Any] = {"unit": panel.unit, "color": {"mode": "thresholds" if instant else "palette-classic"},
                                "mappings": _mappings(panel.mappings), "thresholds": _thresholds(panel.red_from),
                                "custom": _custom(panel.kind)}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    out: dict[str, Any] = {
        "id": pid, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": _overrides(panel)},
        "options": _options(panel.kind), "targets": targets,
    }
    if panel.kind == "table":
        out["transformations"] = _table_transformations(panel)
    return out


def dashboard(*, uid: str, title: str, description: str, tags: Sequence[str], variables: Sequence[dict[str, Any]],
              rows: Sequence[Row]) -> dict[str, Any]:
    """The dashboard JSON model: rows laid out top to bottom, panels left to right, wrapping at 24
    columns. Raises ValueError for a panel wider than the grid."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in rows:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        x, row_height = 0, 0
        for panel in row.panels:
            if not 0 < panel.width <= GRID_WIDTH:
                raise ValueError(f"{title} / {panel.title}: width {panel.width} is not within 1..{GRID_WIDTH}")
            if x + panel.width > GRID_WIDTH:
                x, y, row_height = 0, y + row_height, 0
            panels.append(_panel_json(panel, pid, x, y))
            pid, x, row_height = pid + 1, x + panel.width, max(row_height, panel.height)
        y += row_height
    return {
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": description, "editable": True, "fiscalYearStartMonth": 0, "graphTooltip": 1, "id": None,
        "links": [{"asDropdown": True, "includeVars": True, "keepTime": True, "tags": ["accelstats"],
                   "title": "accelstats", "type": "dashboards"}],
        "panels": panels, "refresh": "30s", "schemaVersion": SCHEMA_VERSION, "tags": list(tags),
        "templating": {"list": list(variables)}, "time": {"from": "now-1h", "to": "now"}, "timepicker": {},
        "timezone": "", "title": title, "uid": uid, "version": 1, "weekStart": "",
    }
