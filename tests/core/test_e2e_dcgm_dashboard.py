"""End to end: dcgm-exporter's own Grafana dashboard works unchanged on accelstats with ``dcgm_names``.

A real Prometheus (Debian's package, ``tests/support/prom_harness.py``) scrapes ``accelstats serve``
running on the replay of ``tests/scenarios/h200_gpm.toml`` (an H200 with GPM metrics and NVLink links, and
an H200 in MIG mode) with ``dcgm_names = true`` and ``nvml_profiling_interval = 1``; then each query of
NVIDIA's dashboard is asked, with its template variables at "All" (``.*``) and at the first value
their ``label_values`` query finds, and must return data.

The dashboard is not copied here. :data:`PANELS` lists, in this project's own table, the series and
labels its queries use, as read from NVIDIA/dcgm-exporter ``grafana/dcgm-exporter-dashboard.json`` at
commit d5e5f510a1b6b393f39a43293ccd9dc985defc79 (2026-05-12): every panel selects one ``DCGM_FI_*``
series by ``instance=~"$instance", gpu=~"$gpu"``, some wrapped in an aggregation or a scale, and its
two template variables are ``label_values(DCGM_FI_DEV_GPU_TEMP, instance)`` and ``…, gpu)``.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ports import free_port
from support.prom_harness import PrometheusServer, ScrapeTarget, prometheus_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e_dcgm_dashboard")]

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "tests" / "scenarios" / "h200_gpm.toml"
SCRAPES = 4

#: (panel title, series, how the query wraps the selected series): the upstream dashboard's panels.
PANELS = [
    ("GPU Temperature", "DCGM_FI_DEV_GPU_TEMP", "{}"),
    ("GPU Avg. Temp", "DCGM_FI_DEV_GPU_TEMP", "avg({})"),
    ("GPU Power Usage", "DCGM_FI_DEV_POWER_USAGE", "{}"),
    ("GPU Power Total", "DCGM_FI_DEV_POWER_USAGE", "sum({})"),
    ("GPU SM Clocks", "DCGM_FI_DEV_SM_CLOCK", "{} * 1000000"),
    ("GPU Utilization", "DCGM_FI_DEV_GPU_UTIL", "{}"),
    ("GPU Framebuffer Mem Used", "DCGM_FI_DEV_FB_USED", "{}"),
    ("Tensor Core Utilization", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "{}"),
]
#: The label matchers every panel query carries, and the dashboard's template variables.
MATCHERS = 'instance=~"$instance", gpu=~"$gpu"'
VARIABLES = {"instance": "label_values(DCGM_FI_DEV_GPU_TEMP, instance)",
             "gpu": "label_values(DCGM_FI_DEV_GPU_TEMP, gpu)"}


def query(panel: tuple[str, str, str], values: dict[str, str]) -> str:
    _, series, wrap = panel
    expr = wrap.format(f"{series}{{{MATCHERS}}}")
    for name, value in values.items():
        expr = expr.replace(f"${name}", value)
    return expr


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@contextlib.contextmanager
def exporter(config: Path, log: Path) -> Iterator[str]:
    """``accelstats serve`` on a free loopback port; yields ``host:port`` once /healthz answers."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{port}",
                                 "--config", str(config)], stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"accelstats serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                if http_status(f"http://127.0.0.1:{port}/healthz") == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"accelstats serve not healthy after 30 s: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def serve_and_scrape(tmp: Path, dcgm_names: bool) -> contextlib.AbstractContextManager[PrometheusServer]:
    @contextlib.contextmanager
    def run() -> Iterator[PrometheusServer]:
        missing = prometheus_unavailable()
        if missing:
            pytest.skip(missing)
        for d in ("cgroup", "proc"):
            (tmp / d).mkdir(exist_ok=True)
        config = tmp / "config.toml"
        config.write_text(f'nvml_replay = "{SCENARIO}"\ncgroup_root = "{tmp / "cgroup"}"\n'
                          f'proc_root = "{tmp / "proc"}"\nnvml_profiling_interval = 1.0\n'
                          f"dcgm_names = {'true' if dcgm_names else 'false'}\n")
        with exporter(config, tmp / "exporter.log") as address, \
                PrometheusServer([ScrapeTarget(address)], workdir=tmp / "prometheus") as server:
            server.wait_for_scrapes(SCRAPES, timeout_s=30)
            yield server
    return run()


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    with serve_and_scrape(tmp_path_factory.mktemp("dcgm"), dcgm_names=True) as server:
        yield server


@pytest.fixture(scope="module")
def variables(prom: PrometheusServer) -> dict[str, list[str]]:
    """Each template variable's values, as Grafana's ``label_values(metric, label)`` finds them."""
    out = {}
    for name, definition in VARIABLES.items():
        metric, label = definition.removeprefix("label_values(").removesuffix(")").split(", ")
        found = prom.query(f"count by ({label}) ({metric})")
        assert found.ok, found.error
        out[name] = sorted(s["metric"].get(label, "") for s in found.series)
    return out


def test_template_variables_find_values(variables: dict[str, list[str]]) -> None:
    assert variables["gpu"] == ["0", "1"]
    assert len(variables["instance"]) == 1 and variables["instance"][0].startswith("127.0.0.1:")


@pytest.mark.parametrize("panel", PANELS, ids=[p[0] for p in PANELS])
def test_each_panel_query_returns_data(prom: PrometheusServer, variables: dict[str, list[str]],
                                       panel: tuple[str, str, str]) -> None:
    for values in ({"instance": ".*", "gpu": ".*"}, {"instance": variables["instance"][0], "gpu": "0"}):
        result = prom.query(query(panel, values))
        assert result.ok, f"{panel[0]}: {result.error}"
        assert result.series, f"{panel[0]}: {query(panel, values)} returned no data"


def test_tensor_core_panel_reads_the_scenarios_any_tensor_util(prom: PrometheusServer) -> None:
    """``any_tensor_util = 55.0`` on GPU 0 → 0.55, dcgm-exporter's ratio; GPU 1 (no value) absent."""
    result = prom.query(query(PANELS[-1], {"instance": ".*", "gpu": ".*"}))
    got = {(s["metric"]["gpu"], s["metric"].get("GPU_I_ID", "")): float(s["value"][1]) for s in result.series}
    assert got == {("0", ""): pytest.approx(0.55), ("1", "1"): pytest.approx(0.65)}


def test_without_dcgm_names_there_are_no_dcgm_series(tmp_path: Path) -> None:
    with serve_and_scrape(tmp_path, dcgm_names=False) as server:
        assert server.query('{__name__=~"DCGM_FI_.*"}').series == []
        assert server.query("accelstats_gpu_tensor_active_ratio").series
