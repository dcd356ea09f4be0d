"""docs/alerts.md says what the rules in prometheus/accelstats.rules.yml do (issue 26 row 11): the
GPU-less-node exclusion of ``AccelstatsCollectorFailing``, which promtool shows in
prometheus/tests/exporter.yml (tests/operations/test_alert_rules.py runs it)."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _rule(name: str) -> dict[str, str]:
    groups = yaml.safe_load((REPO / "prometheus" / "accelstats.rules.yml").read_text())["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r.get("alert") == name]
    return dict(rule)


def test_collector_failing_is_documented_as_quiet_on_gpu_less_nodes() -> None:
    expr = " ".join(_rule("AccelstatsCollectorFailing")["expr"].split())
    assert 'unless on(instance, job, collector) label_replace(accelstats_nvml_state{state="no_device"}' in expr
    doc = (REPO / "docs" / "alerts.md").read_text()
    (row,) = [line for line in doc.splitlines() if line.startswith("| `AccelstatsCollectorFailing` |")]
    assert 'except the `nvidia` collector of a node without NVIDIA devices' in row
    assert '`accelstats_nvml_state{state="no_device"}`' in row
    assert "**`AccelstatsCollectorFailing` on GPU-less nodes stays quiet.**" in doc
    assert "do not enable it there" not in doc
    cases = (REPO / "prometheus" / "tests" / "exporter.yml").read_text()
    assert "a host without NVIDIA devices does not" in cases  # the promtool case the doc cites
