"""GPM samples and NVLink links in the replay, through the real, unchanged pynvml (C ABI).

Expected values are the scenario's (tests/scenarios/h200_gpm.toml), read off the file by hand.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pynvml
import pytest
from support.paths import find_shared

from collectors.replay.gpm import GpmMetric, GpmMetricsGetHeader, GpmSupport
from collectors.replay.lib import ReplayedNVML, open_replay
from collectors.replay.state import ReplayError

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
GPM = SCENARIOS / "h200_gpm.toml"
H200 = find_shared() / "fixtures" / "h200" / "nvidia-smi-q.xml"


@pytest.fixture
def nvml() -> Any:
    n = open_replay(GPM)
    n.nvmlInit()
    yield n
    n.nvmlShutdown()


def metrics(nvml: ReplayedNVML, handle: Any, ids: list[int], gi: int | None = None) -> list[tuple[int, float]]:
    s1, s2 = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    try:
        for s in (s1, s2):
            if gi is None:
                nvml.nvmlGpmSampleGet(handle, s)
            else:
                nvml.nvmlGpmMigSampleGet(handle, gi, s)
        mg = pynvml.c_nvmlGpmMetricsGet_t()
        mg.version, mg.numMetrics, mg.sample1, mg.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, len(ids), s1, s2
        for i, m in enumerate(ids):
            mg.metrics[i].metricId = m
        nvml.nvmlGpmMetricsGet(mg)
        return [(mg.metrics[i].nvmlReturn, mg.metrics[i].value) for i in range(len(ids))]
    finally:
        nvml.nvmlGpmSampleFree(s1)
        nvml.nvmlGpmSampleFree(s2)


def test_layouts_are_nvml_h_and_pynvml_agrees() -> None:
    """nvml.h: nvmlGpmMetric_t is 40 bytes (uint, int, double, three pointers); the metrics array
    starts after version, numMetrics and two sample pointers (24 bytes); pynvml's structures agree."""
    assert ctypes.sizeof(GpmMetric) == ctypes.sizeof(pynvml.c_nvmlGpmMetric_t) == 40
    assert ctypes.sizeof(GpmMetricsGetHeader) == pynvml.c_nvmlGpmMetricsGet_t.metrics.offset == 24
    assert ctypes.sizeof(GpmSupport) == ctypes.sizeof(pynvml.c_nvmlGpmSupport_t) == 8


def test_support_follows_the_scenario_table(nvml: ReplayedNVML) -> None:
    assert nvml.nvmlGpmQueryDeviceSupport(nvml.nvmlDeviceGetHandleByIndex(0)).isSupportedDevice == 1


def test_a_capture_is_not_a_gpm_device() -> None:
    n = open_replay(H200)
    n.nvmlInit()
    try:
        h = n.nvmlDeviceGetHandleByIndex(0)
        assert n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
        with pytest.raises(pynvml.NVMLError_NotSupported):
            n.nvmlGpmSampleGet(h, n.nvmlGpmSampleAlloc())
        with pytest.raises(pynvml.NVMLError_NotSupported):
            n.nvmlDeviceGetNvLinkState(h, 0)  # as the H200 PCIe card answered (nvml_probe.json)
    finally:
        n.nvmlShutdown()


def test_metrics_between_two_samples_are_the_scenarios(nvml: ReplayedNVML) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    ids = [pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
           pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, pynvml.NVML_GPM_METRIC_FP32_UTIL,
           pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, 0]
    assert metrics(nvml, h, ids) == [(0, 80.0), (0, 55.0), (0, 30.0), (0, 12.5),
                                     (pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0), (pynvml.NVML_ERROR_INVALID_ARGUMENT, 0.0)]


def test_mig_instances_have_their_own_metrics(nvml: ReplayedNVML) -> None:
    parent = nvml.nvmlDeviceGetHandleByIndex(1)
    assert metrics(nvml, parent, [pynvml.NVML_GPM_METRIC_SM_UTIL], gi=1) == [(0, 70.0)]
    assert metrics(nvml, parent, [pynvml.NVML_GPM_METRIC_SM_UTIL]) == [(0, 60.0)]
    with pytest.raises(pynvml.NVMLError_NotSupported):  # instance 2 has no [gpu.mig.gpm]
        nvml.nvmlGpmMigSampleGet(parent, 2, nvml.nvmlGpmSampleAlloc())
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpmMigSampleGet(parent, 9, nvml.nvmlGpmSampleAlloc())
    with pytest.raises(pynvml.NVMLError_NotSupported):  # GPU 0 is not in MIG mode
        nvml.nvmlGpmMigSampleGet(nvml.nvmlDeviceGetHandleByIndex(0), 1, nvml.nvmlGpmSampleAlloc())


def test_metrics_get_checks_version_and_samples(nvml: ReplayedNVML) -> None:
    h0, h1 = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    a, b, fresh = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmSampleGet(h0, a)
    nvml.nvmlGpmSampleGet(h1, b)
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version, mg.numMetrics, mg.sample1, mg.sample2 = 2, 1, a, a
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlGpmMetricsGet(mg)
    mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    for s1, s2 in ((a, b), (a, fresh)):  # two GPUs; a sample never filled
        mg.sample1, mg.sample2 = s1, s2
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nvml.nvmlGpmMetricsGet(mg)
    mg.sample1, mg.sample2, mg.numMetrics = a, a, pynvml.NVML_GPM_METRIC_MAX + 1
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpmMetricsGet(mg)
    nvml.nvmlGpmSampleFree(a)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # freed twice
        nvml.nvmlGpmSampleFree(a)


def test_support_version_is_checked(nvml: ReplayedNVML) -> None:
    support = pynvml.c_nvmlGpmSupport_t()
    support.version = 7
    fn = pynvml._nvmlGetFunctionPointer("nvmlGpmQueryDeviceSupport")  # the handle selects the replay
    ret = fn(nvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(support))
    assert ret == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_nvlink_links(nvml: ReplayedNVML) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert [nvml.nvmlDeviceGetNvLinkState(h, link) for link in (0, 1)] == [1, 0]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(h, 2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetNvLinkState(h, pynvml.NVML_NVLINK_MAX_LINKS)
    counters = [pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
                pynvml.NVML_NVLINK_ERROR_DL_RECOVERY]
    assert [nvml.nvmlDeviceGetNvLinkErrorCounter(h, 1, c) for c in counters] == [3, 2, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkErrorCounter(h, 1, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA)
    tx, rx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    values = nvml.nvmlDeviceGetFieldValues(h, [(tx, 0), (rx, 0), (tx, 5)])
    assert [(v.nvmlReturn, v.valueType, v.value.ullVal) for v in values] == [
        (0, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 1024), (0, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 2048),
        (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0)]


def test_before_r525_there_is_no_gpm(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text(GPM.read_text().replace('"580.159.04"', '"515.105.01"').replace(
        "../shared/fixtures/h200/nvidia-smi-q.xml", str(H200)))
    n = open_replay(path)
    n.nvmlInit()
    try:
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            n.nvmlGpmQueryDeviceSupport(n.nvmlDeviceGetHandleByIndex(0))
    finally:
        n.nvmlShutdown()


@pytest.mark.parametrize(("table", "message"), [
    ("[gpu.gpm]\nsm_utl = 1.0", "gpu[0].gpm.sm_utl: unknown key"),
    ("[gpu.gpm]\nsm_util = 101.0", "gpu[0].gpm.sm_util: a percentage: must be 0-100"),
    ("[gpu.gpm]\nsm_util = \"high\"", "gpu[0].gpm.sm_util: expected a number"),
    ("[gpu.gpm]\nsm_util = -1.0", "gpu[0].gpm.sm_util: must not be negative"),
    ("[[gpu.nvlink]]\nstate = \"up\"", "gpu[0].nvlink[0].link: missing required key"),
    ("[[gpu.nvlink]]\nlink = 36", "gpu[0].nvlink[0].link: must be at most 35"),
    ("[[gpu.nvlink]]\nlink = 0\nstate = \"flapping\"", "gpu[0].nvlink[0].state: expected 'up' or 'down'"),
    ("[[gpu.nvlink]]\nlink = 0\n[[gpu.nvlink]]\nlink = 0", "gpu[0].nvlink[1].link: link 0 is given twice"),
    ("[[gpu.nvlink]]\nlink = 0\nthroughput_data_tx = -5", "gpu[0].nvlink[0].throughput_data_tx: must not be negative"),
])
def test_malformed_tables_are_refused_by_key(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f'[[gpu]]\ncapture = "{H200}"\n{table}\n')
    with pytest.raises(ReplayError, match=message.replace("[", r"\[").replace("]", r"\]")):
        open_replay(path)
