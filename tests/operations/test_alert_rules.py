"""The alert rules in prometheus/accelstats.rules.yml and their promtool unit tests (docs/alerts.md).

* ``promtool check rules`` accepts the file and ``promtool test rules prometheus/tests/*.yml`` passes;
  every alert has a unit-test case in which it fires and one in which it stays quiet, and no unit test
  names an alert the rules do not define (a test of a missing alert would expect silence and pass).
* Every alert has an Alertmanager-style name, a ``severity`` label and ``summary``, ``description`` and
  ``runbook`` annotations that template the labels identifying the node and the GPU, container, MPS
  resource, file device or collector.
* Every family a rule names is declared in accelstats/catalog.py (or is Prometheus' own ``up``), every
  label a rule matches on is one of that family's labels, and every label value it matches is one the
  exporter emits (``accelstats dump`` of the H200 capture), one spec/metrics.md names (``attribution``),
  or, for ``xid``, exactly collectors/xid.py's APPLICATION_XIDS: a renamed family, label or value breaks
  these tests.

promtool comes from Debian's ``prometheus`` package (.ci/run installs it); without it these tests skip,
and under ``CI=true`` they fail. The PromQL reading here is a tokenizer that finds selectors
(``name{label op "value"}``), enough for the rules file; it refuses a selector without a metric name.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, in_ci, require_tool
from prometheus_client.parser import text_string_to_metric_families

from accelstats import catalog
from collectors.nvidia import NVML_STATES
from collectors.nvlink import ERROR_TYPES as NVLINK_ERROR_TYPES
from collectors.xid import APPLICATION_XIDS

try:
    import yaml
except ImportError:  # PyYAML reads the rules and unit-test files; under CI=true its absence is an error
    if in_ci():
        raise
    pytest.skip("PyYAML not installed", allow_module_level=True)


def promtool() -> str:
    """promtool (skips without it; fails under CI=true)."""
    return require_tool("promtool", "prometheus")


RULES = REPO_ROOT / "prometheus" / "accelstats.rules.yml"
RECORDING = REPO_ROOT / "prometheus" / "accelstats.recording.yml"
UNIT_TESTS = sorted((REPO_ROOT / "prometheus" / "tests").glob("*.yml"))
SEVERITIES = {"critical", "warning", "info"}
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
FAMILY_LABELS: dict[str, set[str]] = {f.name: set(f.labels) for f in catalog.ALL} | {"up": set()}
# labels that say which thing an alert is about: an alert on a family with one must template it
IDENTITY_LABELS = ("uuid", "id", "resource", "device", "collector")




@cache
def rule_groups() -> list[dict[str, Any]]:
    """The ``groups`` of the rules file, as PyYAML reads it."""
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def alerts() -> list[dict[str, Any]]:
    """Every alerting rule (``alert``, ``expr``, ``for``, ``labels``, ``annotations``), in file order."""
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


# --------------------------------------------------------------------------------------------
# PromQL selectors

TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*\b)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}])
""", re.VERBOSE)
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"and", "or", "unless", "offset", "bool", "atan2", "inf", "nan", "Inf", "NaN"}
AGGREGATORS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
               "topk", "quantile"}


@dataclass(frozen=True)
class Selector:
    """One instant or range selector: the metric name and its ``(label, op, value)`` matchers."""

    metric: str
    matchers: tuple[tuple[str, str, str], ...] = ()


def tokens(expr: str) -> list[tuple[str, str]]:
    """``(kind, text)`` tokens of a PromQL expression, whitespace dropped; ValueError on a stray character."""
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read PromQL at {expr[pos:pos + 20]!r}")
        assert m.lastgroup is not None
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def selectors(expr: str) -> list[Selector]:
    """The selectors of ``expr`` in order. Label lists of by/on/… and function names are not metrics;
    ValueError for a selector with no metric name (``{__name__=~…}``), which this check cannot follow."""
    toks = tokens(expr) + [("end", "")]
    out: list[Selector] = []
    i = 0
    while i < len(toks) - 1:
        kind, text = toks[i]
        following = toks[i + 1][1]
        if kind == "ident" and text in GROUPING and following == "(":
            i = toks.index(("op", ")"), i) + 1
        elif kind == "ident" and (text in KEYWORDS or text in AGGREGATORS or following == "("):
            i += 1
        elif kind == "ident":
            matchers: list[tuple[str, str, str]] = []
            i += 1
            if following == "{":
                i += 1
                while toks[i][1] != "}":
                    (lkind, label), (_, op), (vkind, value) = toks[i:i + 3]
                    if lkind != "ident" or vkind != "string":
                        raise ValueError(f"cannot read matcher {label}{op}{value} in {expr!r}")
                    matchers.append((label, op, ast.literal_eval(value)))
                    i += 4 if toks[i + 3][1] == "," else 3
                i += 1
            out.append(Selector(text, tuple(matchers)))
        elif text == "{":
            raise ValueError(f"selector without a metric name in {expr!r}")
        else:
            i += 1
    return out


def rule_selectors() -> Iterator[tuple[str, Selector]]:
    """``(alert name, selector)`` for every selector of every alert."""
    for rule in alerts():
        for sel in selectors(rule["expr"]):
            yield rule["alert"], sel


def unknown_families(rules_text: str) -> set[str]:
    """Metric names used in the alert expressions of ``rules_text`` that the catalog does not declare."""
    names = {sel.metric for group in yaml.safe_load(rules_text)["groups"] for rule in group["rules"]
             for sel in selectors(rule["expr"])}
    return names - set(FAMILY_LABELS)


def alternatives(op: str, value: str) -> set[str]:
    """The values a matcher names: ``value`` for = and !=, the branches of a plain ``a|b|c`` regex."""
    if op in ("=", "!="):
        return {value}
    if not re.fullmatch(r"[A-Za-z0-9_.:/-]+(\|[A-Za-z0-9_.:/-]+)*", value):
        raise ValueError(f"regex {value!r} is not a plain alternation: extend this check")
    return set(value.split("|"))


# --------------------------------------------------------------------------------------------
# the reader itself


def test_selectors_reads_names_matchers_and_skips_label_lists() -> None:
    expr = ('max by (job, uuid) (max_over_time(accelstats_gpu_info{kind="gpu"}[3h])) '
            'unless on (job, instance, uuid) accelstats_gpu_info offset 5m '
            'and on (job) (up{job=~"accelstats.*"} == 0)')
    assert selectors(expr) == [
        Selector("accelstats_gpu_info", (("kind", "=", "gpu"),)),
        Selector("accelstats_gpu_info"),
        Selector("up", (("job", "=~", "accelstats.*"),)),
    ]
    with pytest.raises(ValueError, match="without a metric name"):
        selectors('{__name__="accelstats_gpu_up"} == 0')


def test_a_renamed_family_is_caught() -> None:
    text = RULES.read_text()
    assert unknown_families(text) == set()
    renamed = text.replace("accelstats_gpu_row_remap_failure", "accelstats_gpu_row_remap_failed")
    assert unknown_families(renamed) == {"accelstats_gpu_row_remap_failed"}


# --------------------------------------------------------------------------------------------
# promtool


def test_promtool_check_rules_accepts_the_file() -> None:
    proc = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    assert UNIT_TESTS, "no unit tests in prometheus/tests"
    proc = subprocess.run([promtool(), "test", "rules", *map(str, UNIT_TESTS)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(UNIT_TESTS), proc.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] in (["../accelstats.rules.yml"], ["../accelstats.recording.yml"]), path
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert (fires | quiet) - names == set(), "unit tests of alerts that do not exist"
    assert names - fires == set(), "alerts without a case where they fire"
    assert names - quiet == set(), "alerts without a case where they stay quiet"


# --------------------------------------------------------------------------------------------
# names, labels, annotations


def test_alert_names_are_unique_and_in_alertmanager_style() -> None:
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names))
    for name in names:
        assert re.fullmatch(r"Accelstats(?:[A-Z][a-z0-9]*)+", name), name


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    for rule in alerts():
        assert rule.get("labels", {}).get("severity") in SEVERITIES, rule["alert"]
        for key in ("summary", "description", "runbook"):
            assert rule.get("annotations", {}).get(key, "").strip(), f"{rule['alert']}: no {key}"


def test_annotations_template_the_labels_that_identify_the_alert() -> None:
    """Annotations name the node and the thing (GPU, container, …) and only labels the series carry."""
    for rule in alerts():
        first = selectors(rule["expr"])[0]
        carried = FAMILY_LABELS[first.metric] | TARGET_LABELS
        text = " ".join(rule["annotations"].values())
        used = set(re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", text))
        assert used <= carried, f"{rule['alert']} templates labels its series lack: {used - carried}"
        if rule["expr"].startswith("absent("):
            assert used == set(), rule["alert"]  # absent() keeps no labels of a regex selector
            continue
        assert "instance" in used, f"{rule['alert']} does not name the node"
        for label in IDENTITY_LABELS:
            if label in FAMILY_LABELS[first.metric]:
                assert label in used, f"{rule['alert']} does not template {label}"


def test_recording_rules_load_and_read_only_catalog_families() -> None:
    proc = subprocess.run([promtool(), "check", "rules", str(RECORDING)], capture_output=True, text=True,
                          timeout=60, check=False)
    records = [rule for group in yaml.safe_load(RECORDING.read_text())["groups"] for rule in group["rules"]]
    assert proc.returncode == 0 and f"SUCCESS: {len(records)} rules found" in proc.stdout, proc.stdout + proc.stderr
    for rule in records:
        assert re.fullmatch(r"namespace:accelstats_[a-z_]+:rate5m", rule["record"]), rule["record"]
        for sel in selectors(rule["expr"]):
            assert sel.metric in FAMILY_LABELS and FAMILY_LABELS[sel.metric] >= {"namespace"}, rule["record"]


def test_rules_name_only_catalog_families_and_their_labels() -> None:
    for alert, sel in rule_selectors():
        assert sel.metric in FAMILY_LABELS, f"{alert}: {sel.metric} is not a family of accelstats/catalog.py"
        for label, _, _ in sel.matchers:
            assert label in FAMILY_LABELS[sel.metric] | TARGET_LABELS, f"{alert}: {sel.metric} has no {label}"


@cache
def emitted_values(capture: Path) -> dict[tuple[str, str], set[str]]:
    """``{(family, label): values}`` in ``accelstats dump --nvml-replay capture``."""
    proc = subprocess.run([sys.executable, "-m", "accelstats", "dump", "--nvml-replay", str(capture)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    seen: dict[tuple[str, str], set[str]] = {}
    for family in text_string_to_metric_families(proc.stdout):
        for sample in family.samples:
            for label, value in sample.labels.items():
                seen.setdefault((sample.name, label), set()).add(value)
    return seen


def spec_attributions(shared_dir: Path) -> set[str]:
    """The ``attribution`` values spec/metrics.md §3 lists: "`attribution` (`a`, `b`, `c`)"."""
    text = (shared_dir / "spec" / "metrics.md").read_text()
    m = re.search(r"`attribution` \(([^)]*)\)", text)
    assert m is not None, "spec/metrics.md no longer lists the attribution values"
    return set(re.findall(r"`([a-z_]+)`", m.group(1)))


def test_matched_label_values_are_ones_the_exporter_emits(fixtures_dir: Path, shared_dir: Path) -> None:
    emitted = emitted_values(fixtures_dir / "h200" / "nvidia-smi-q.xml")
    known = {("accelstats_container_gpu_processes", "attribution"): spec_attributions(shared_dir),
             ("accelstats_nvml_state", "state"): set(NVML_STATES),
             ("accelstats_gpu_nvlink_errors_total", "type"): {label for label, _ in NVLINK_ERROR_TYPES}}
    checked = set()
    for alert, sel in rule_selectors():
        for label, op, value in sel.matchers:
            if label in TARGET_LABELS or label == "xid":  # xid: next test
                continue
            key = (sel.metric, label)
            allowed = known.get(key) or emitted.get(key)
            assert allowed, f"{alert}: no source of values for {key}; add one to this test"
            assert alternatives(op, value) <= allowed, f"{alert}: {sel.metric}{{{label}{op}{value!r}}}"
            checked.add(key)
    # the rules match on these; if one disappears the test above was not exercised for it
    assert {("accelstats_gpu_clock_event_active", "reason"), ("accelstats_gpu_ecc_errors_total", "type"),
            ("accelstats_container_gpu_processes", "attribution")} <= checked


def test_application_xids_are_those_of_collectors_xid() -> None:
    seen = 0
    for alert, sel in rule_selectors():
        for label, op, value in sel.matchers:
            if label == "xid":
                assert {int(x) for x in alternatives(op, value)} == APPLICATION_XIDS, alert
                seen += 1
    assert seen >= 2, "the XID alerts no longer split application XIDs from the others"
