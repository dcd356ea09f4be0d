"""A GPU's own state in a scenario, a product feature (docs/replay.md, "A device's state over time"):

| ``[[gpu]]`` key | what the replayed NVML does |
|---|---|
| ``lost_at_s = T`` | from T s after the first nvmlInit, every call naming the GPU answers GPU_IS_LOST |
| ``[gpu.errors]`` ``call = "ERROR"`` | that call on that GPU answers NVML_ERROR_<ERROR> (``"*"``: every call) |
| ``[gpu.hangs]`` ``call = S`` | that call on that GPU blocks S s first (``"*"``: every call) |
| ``[[gpu.xid]]`` ``xid``, ``at_s`` | an XID event (test_nvml_replay.py, "events") |

The example scenarios of docs/replay.md and docs/dashboards.md run in the product, without the test
rig (``tests/support/site`` is not on the ``PYTHONPATH`` of the process started here).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.faultmatrix_util import wait_healthy
from support.paths import find_shared
from support.ports import free_port

from collectors.replay.lib import ReplayedNVML, open_replay

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = REPO / "tests" / "scenarios"
H200 = find_shared() / "fixtures" / "h200" / "nvidia-smi-q.xml"


class FakeTime:
    """A clock (seconds since the epoch) and a sleep that moves it, recording what it slept."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def temperature(nvml: ReplayedNVML, gpu: int) -> int:
    return int(nvml.nvmlDeviceGetTemperature(nvml.nvmlDeviceGetHandleByIndex(gpu), pynvml.NVML_TEMPERATURE_GPU))


def test_the_second_gpu_falls_off_the_bus_at_lost_at_s() -> None:
    """h200_pair_one_lost.toml: GPU 1 has ``lost_at_s = 30``."""
    t = FakeTime()
    nvml = open_replay(SCENARIOS / "h200_pair_one_lost.toml", clock=t, sleep=t.sleep)
    t.now += 100  # loading is not the start: the time counts from the first nvmlInit
    nvml.nvmlInit()
    lost = nvml.nvmlDeviceGetHandleByIndex(1)
    t.now += 29.9
    assert temperature(nvml, 1) == 35
    t.now += 0.1
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetPowerUsage(lost)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(1)
    t.now += 3600
    with pytest.raises(pynvml.NVMLError_GpuIsLost):  # it stays lost
        nvml.nvmlDeviceGetName(lost)
    assert temperature(nvml, 0) == 35 and nvml.nvmlDeviceGetCount() == 2  # the other GPU and the system answer
    nvml.nvmlShutdown()


@pytest.mark.parametrize(("table", "gpu0", "gpu1", "slept"), [
    # (the [[gpu]] tables of GPU 1, what nvmlDeviceGetTemperature answers on GPU 0 and 1, the sleeps)
    ('[gpu.errors]\nnvmlDeviceGetTemperature = "NO_PERMISSION"', 35, "NoPermission", []),
    ('[gpu.errors]\n"*" = "UNKNOWN"', 35, "Unknown", []),
    ('[gpu.errors]\nnvmlDeviceGetPowerUsage = "UNKNOWN"', 35, 35, []),
    ("[gpu.hangs]\nnvmlDeviceGetTemperature = 5", 35, 35, [5.0]),
    ('[gpu.hangs]\n"*" = 2.5', 35, 35, [2.5, 2.5]),  # nvmlDeviceGetHandleByIndex(1) names it too
    ('[gpu.hangs]\nnvmlDeviceGetTemperature = 5\n[gpu.errors]\nnvmlDeviceGetTemperature = "TIMEOUT"', 35, "Timeout",
     [5.0]),
])
def test_calls_on_one_gpu_fail_or_hang(tmp_path: Path, table: str, gpu0: int, gpu1: int | str,
                                       slept: list[float]) -> None:
    path = tmp_path / "scenario.toml"
    path.write_text(f'[[gpu]]\ncapture = "{H200}"\n'
                    f'[[gpu]]\ncapture = "{H200}"\nuuid = "GPU-other"\nminor = 1\n{table}\n')
    t = FakeTime()
    nvml = open_replay(path, clock=t, sleep=t.sleep)
    nvml.nvmlInit()
    assert temperature(nvml, 0) == gpu0 and t.slept == []
    try:
        got: int | str = temperature(nvml, 1)
    except pynvml.NVMLError as exc:
        got = type(exc).__name__.removeprefix("NVMLError_")
    assert (got, t.slept) == (gpu1, slept)
    nvml.nvmlShutdown()


def metrics(port: int) -> dict[str, dict[str, float]]:
    """{family sample name: {GPU index or NVML call/error: value}} of ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.labels.get("gpu") or f"{s.labels.get('call')}/{s.labels.get('error')}"
            out.setdefault(s.name, {})[key] = s.value
    return out


def test_accelstats_serve_runs_the_fleet_scenario_without_the_test_rig(tmp_path: Path) -> None:
    """docs/dashboards.md's h200_fleet.toml as a user runs it: GPU 2 is lost 2 s in and shown down, GPU 1's
    encoder utilisation is refused (NO_PERMISSION, counted), GPU 0 reports XID 79."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no tests/support/site: no test rig
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{port}",
                                 "--nvml-replay", str(SCENARIOS / "h200_fleet.toml")],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, port, log, 30)
        deadline = time.monotonic() + 30
        while True:
            got = metrics(port)
            if got["accelstats_gpu_up"].get("2") == 0 and got.get("accelstats_gpu_critical_xid", {}).get("0"):
                break
            assert time.monotonic() < deadline, (got.get("accelstats_gpu_up"), log.read_text()[-2000:])
            time.sleep(0.2)  # polling the exporter for the moment the lost GPU is reported
        assert got["accelstats_gpu_up"] == {"0": 1.0, "1": 1.0, "2": 0.0}
        assert got["accelstats_gpu_critical_xid"]["0"] == 79
        assert got["accelstats_nvml_errors_total"]["nvmlDeviceGetEncoderUtilization/NO_PERMISSION"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "test support" not in log.read_text()


def test_error_names_are_nvmls() -> None:
    """``[gpu.errors]`` takes the nvml.h names pynvml defines (collectors.replay.capture.NVML_ERRORS)."""
    from collectors.replay.capture import NVML_ERRORS

    assert {n.removeprefix("NVML_ERROR_") for n in dir(pynvml) if n.startswith("NVML_ERROR_")} == NVML_ERRORS
