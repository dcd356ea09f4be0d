"""The Grafana dashboards in grafana/dashboards, checked as files (no Grafana, no Prometheus).

| check | why |
|---|---|
| the committed JSON is what ``grafana/generate.py`` writes | the generator is the source; hand edits would be lost |
| a row wider than the grid is refused by ``grafana/panels.py`` | the SDK's layout would run it past column 24 |
| valid JSON, schemaVersion, unique uid and title | Grafana refuses or merges dashboards otherwise |
| panel ids unique, panels inside the 24-column grid and not overlapping | Grafana re-lays out or drops them |
| every panel has a known unit (``fieldConfig.defaults.unit``) and a description | the dashboards' contract |
| every panel and query uses the ``$datasource`` variable, a Prometheus datasource variable | portable import |
| the required template variables exist, and every ``$var`` used is defined | a typo shows as a literal ``$var`` |
| every metric in every expression is a catalog family, every label matcher one of its labels | renames break here |

The generator builds the dashboards with grafana-foundation-sdk (the ``test`` extra; Python 3.11+):
without it the two generator checks skip, except under ``CI=true`` on Python 3.11+, where they fail.
The other checks read the committed JSON and need nothing installed.

The expressions are run against a real Prometheus in ``test_e2e_prometheus.py``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import in_ci
from support.dashboards import (
    DASHBOARD_DIR,
    FILES,
    GRAFANA,
    exprs,
    load,
    panels,
    selectors,
)

from accelstats import catalog

#: Grafana unit ids used here (grafana-data ``valueFormats/categories.ts``); a new one must be a real id.
KNOWN_UNITS = {"none", "short", "percent", "percentunit", "bytes", "Bps", "watt", "joule", "celsius", "hertz", "s",
               "bool_yes_no", "h", "kwatth"}  # h: hours (Time); kwatth: kilowatt-hour (Energy)
REQUIRED_VARIABLES = {
    "gpu-fleet.json": {"datasource", "instance", "gpu"},
    "containers.json": {"datasource", "instance", "gpu", "namespace", "pod", "alloc"},
    "mps-and-file-devices.json": {"datasource", "instance", "gpu", "resource"},
    "gpu-accounting.json": {"datasource", "instance", "gpu", "namespace", "pod", "alloc"},
}
FAMILIES = {f.name: f for f in catalog.ALL}
SCRAPE_LABELS = ("instance", "job")  # added by Prometheus to every scraped series


def require_sdk() -> None:
    """Skip (fail under CI on Python 3.11+) when grafana-foundation-sdk, which generate.py builds with, is
    missing. The SDK needs Python 3.11+ (its wheel's Requires-Python), so the `test` extra installs it
    only there: on 3.10 the check skips even under CI."""
    if importlib.util.find_spec("grafana_foundation_sdk") is not None:
        return
    reason = ("grafana-foundation-sdk is not installed: grafana/generate.py builds the dashboards with it "
              "(pip install -e '.[test]'; Python 3.11+)")
    if in_ci() and sys.version_info >= (3, 11):
        pytest.fail(f"{reason}; CI=true and Python 3.11+, so the `test` extra must provide it")
    pytest.skip(reason)


def load_generator() -> ModuleType:
    """grafana/generate.py as a module (it imports its sibling panels.py and grafana-foundation-sdk)."""
    require_sdk()
    sys.path.insert(0, str(GRAFANA))
    try:
        spec = importlib.util.spec_from_file_location("accelstats_grafana_generate", GRAFANA / "generate.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(GRAFANA))








# --- PromQL: the metric names and matcher labels of an expression ---------------------------------------





@pytest.mark.parametrize(("expr", "expected"), [
    ('sum by (instance) (rate(a_total{x=~"$v", y!="b{c}"}[$__rate_interval])) / on (instance) b',
     [("a_total", ["x", "y"]), ("b", [])]),
    ('topk($topn, c{z="1"} * on (id) group_left (t) d_info{k=""}) > 0.5e3', [("c", ["z"]), ("d_info", ["k"])]),
    ("count(e == 0) or vector(0)", [("e", [])]),
    ("time() - f offset 5m", [("f", [])]),
])
def test_selector_extraction(expr: str, expected: list[tuple[str, list[str]]]) -> None:
    assert selectors(expr) == expected


# --- the files ----------------------------------------------------------------------------------------


def test_the_dashboards_are_there_and_up_to_date() -> None:
    rendered = load_generator().render()
    assert sorted(rendered) == sorted(REQUIRED_VARIABLES)
    assert [p.name for p in FILES] == sorted(rendered), "a JSON file in grafana/dashboards the generator does not write"
    stale = [name for name, text in rendered.items() if (DASHBOARD_DIR / name).read_text() != text]
    assert not stale, f"run python3 grafana/generate.py: {stale} differ from what it writes"


def test_a_row_wider_than_the_grid_is_refused() -> None:
    """The SDK lays panels out left to right and wraps only after a full 24-column line, so 16 + 12
    would put the second panel at x = 16 .. 28; panels.dashboard refuses that instead of writing it."""
    generator = load_generator()  # it imports ts, query and dashboard from grafana/panels.py
    ts, query, dashboard = generator.ts, generator.query, generator.dashboard

    def row(first_width: int) -> tuple[str, list[Any]]:
        return ("r", [ts("a", "panel a of the row", "short", [query("up")], first_width),
                      ts("b", "panel b of the row", "short", [query("up")], 12)])

    with pytest.raises(ValueError, match=r"t / b: x 16 \+ width 12 runs past the 24-column grid"):
        dashboard(uid="u", title="t", description="d", tags=[], variables=[], rows=[row(16)])
    fits = dashboard(uid="u", title="t", description="d", tags=[], variables=[], rows=[row(12)])
    assert [(p.grid_pos.x, p.grid_pos.y, p.id_val) for p in fits.panels] == [(0, 0, 1), (0, 1, 2), (12, 1, 3)]


def test_uids_and_titles_are_unique() -> None:
    models = [load(p) for p in FILES]
    for model in models:
        assert isinstance(model["schemaVersion"], int) and model["schemaVersion"] >= 39
        assert model["uid"] and len(model["uid"]) <= 40 and model["title"]
    assert len({m["uid"] for m in models}) == len({m["title"] for m in models}) == len(models)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_panel_ids_are_unique_and_the_grid_holds(path: Path) -> None:
    all_panels = list(panels(load(path)))
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    cells: dict[tuple[int, int], str] = {}
    for p in all_panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_panel_has_a_unit_and_a_description(path: Path) -> None:
    for p in panels(load(path)):
        if p["type"] == "row":
            continue
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        assert unit in KNOWN_UNITS, f"{p['title']!r}: unit {unit!r} (known: {sorted(KNOWN_UNITS)})"
        for override in p["fieldConfig"].get("overrides", []):
            for prop in override["properties"]:
                if prop["id"] == "unit":
                    assert prop["value"] in KNOWN_UNITS, f"{p['title']!r}: override unit {prop['value']!r}"
        assert len(p.get("description", "")) >= 20, f"{p['title']!r} has no description"
        assert p.get("targets"), f"{p['title']!r} has no query"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_query_uses_the_datasource_variable(path: Path) -> None:
    model = load(path)
    (ds,) = [v for v in model["templating"]["list"] if v["name"] == "datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    expected = {"type": "prometheus", "uid": "${datasource}"}
    for p in panels(model):
        if p["type"] == "row":
            continue
        assert p["datasource"] == expected, p["title"]
        assert all(t["datasource"] == expected for t in p["targets"]), p["title"]
    for v in model["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"] == expected, v["name"]


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_template_variables_are_defined(path: Path) -> None:
    model = load(path)
    defined = {v["name"] for v in model["templating"]["list"]}
    assert REQUIRED_VARIABLES[path.name] <= defined
    used: set[str] = set()
    for text in _strings(model):
        for m in re.finditer(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", text):
            name = next(g for g in m.groups() if g)
            if not name.startswith("__"):  # Grafana's built-ins: $__rate_interval, $__range, ...
                used.add(name)
    assert used <= defined, f"undefined variables: {sorted(used - defined)}"
    assert defined - {"datasource"} <= used, f"variables no query uses: {sorted(defined - used - {'datasource'})}"


def _check_selectors(where: str, expr: str) -> list[str]:
    problems = []
    for metric, labels in selectors(expr):
        family = FAMILIES.get(metric)
        if family is None:
            problems.append(f"{where}: {metric} is not a family of accelstats/catalog.py")
            continue
        unknown = set(labels) - set(family.labels) - set(SCRAPE_LABELS)
        if unknown:
            problems.append(f"{where}: {metric} has no label {sorted(unknown)} (labels: {family.labels})")
    return problems


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_metric_and_label_is_in_the_catalog(path: Path) -> None:
    model = load(path)
    problems: list[str] = []
    count = 0
    for title, expr in exprs(model):
        count += 1
        problems += _check_selectors(title, expr)
    for v in model["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"])
        assert m, f"variable {v['name']}: expected label_values(selector, label), got {v['query']!r}"
        problems += _check_selectors(f"variable {v['name']}", m.group(1))
        (metric, _), *_ = selectors(m.group(1))
        if metric in FAMILIES and m.group(2) not in FAMILIES[metric].labels + SCRAPE_LABELS:
            problems.append(f"variable {v['name']}: {metric} has no label {m.group(2)}")
    assert count > 0
    assert not problems, "\n".join(problems)


def test_a_renamed_family_would_fail() -> None:
    """The check above is not vacuous: a misspelt family and an unknown label are both reported."""
    assert _check_selectors("t", 'accelstats_gpu_utilisation_ratio{uuid="x"}') == [
        "t: accelstats_gpu_utilisation_ratio is not a family of accelstats/catalog.py"]
    assert "no label ['sensor']" in _check_selectors("t", 'accelstats_gpu_power_watts{sensor="gpu"}')[0]


def test_provisioning_points_at_the_dashboards() -> None:
    provider = (GRAFANA / "provisioning" / "dashboards.yml").read_text()
    assert re.search(r"^apiVersion: 1$", provider, re.M)
    assert re.search(r"^\s+type: file$", provider, re.M)
    assert re.search(r"^\s+path: \S*/dashboards$", provider, re.M)
    datasources = (GRAFANA / "provisioning" / "datasources.yml").read_text()
    assert re.search(r"^\s+type: prometheus$", datasources, re.M)
