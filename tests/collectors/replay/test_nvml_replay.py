"""The replayed libnvidia-ml, through the real pynvml, against every capture in the shared fixtures.

Expected values are read off the captures by hand (and, for the H200, off nvml_probe.json, which
recorded what real NVML answered on that machine), never computed by the code under test.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import json
import math
import re
import shutil
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.paths import find_shared

from collectors.replay.device_state import ScheduledXids
from collectors.replay.lib import ReplayedNVML, open_replay
from collectors.replay.state import IMPLEMENTED_CALLS, ReplayError, mig_uuid

FIXTURES = find_shared() / "fixtures"
H200 = FIXTURES / "h200" / "nvidia-smi-q.xml"
PROBE = FIXTURES / "h200" / "nvml_probe.json"
A100 = FIXTURES / "public" / "a100-sxm4-v12.xml"
A5000 = FIXTURES / "public" / "dual_a5000-v13.xml"
T4 = FIXTURES / "public" / "tesla-t4.xml"
SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
MIB = 1 << 20
NA = 0xFFFFFFFF  # NVML's gpuInstanceId / computeInstanceId outside MIG
H200_UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
A100_UUID = "GPU-513536b6-7d19-9063-b049-1e69664bb298"


class FakeClock:
    """Wall clock the tests move by hand (seconds since the epoch)."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def opened(path: Path, **kwargs: Any) -> ReplayedNVML:
    nvml = open_replay(path, **kwargs)
    nvml.nvmlInit()
    return nvml


def call(nvml: ReplayedNVML, gpu: int, name: str, *args: Any) -> Any:
    """``nvml.<name>(handle of GPU gpu, *args)``."""
    return getattr(nvml, name)(nvml.nvmlDeviceGetHandleByIndex(gpu), *args)


def events_of(nvml: ReplayedNVML) -> list[Any]:
    """The scenario's ``[[gpu.xid]]`` tables as scheduled: (NVML index, XidCapture), GPU by GPU."""
    source = nvml.state.event_source
    return [e for _, e in sorted(source.events)] if isinstance(source, ScheduledXids) else []


def address(handle: Any) -> int | None:
    """The pointer value of a device handle: pynvml hands out a new ctypes object per call, so two
    handles of one device are equal by address, not identical."""
    return ctypes.cast(handle, ctypes.c_void_p).value


def scenario(tmp_path: Path, text: str, name: str = "scenario.toml") -> Path:
    path = tmp_path / name
    path.write_text(text.replace("@H200", H200.as_posix()).replace("@A5000", A5000.as_posix())
                    .replace("@A100", A100.as_posix()))
    return path


# -- identity ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("capture", "gpu", "name", "args", "expected"), [
    (H200, 0, "nvmlDeviceGetName", (), "NVIDIA H200"),
    (H200, 0, "nvmlDeviceGetUUID", (), H200_UUID),
    (H200, 0, "nvmlDeviceGetSerial", (), "1650000000001"),
    (H200, 0, "nvmlDeviceGetMinorNumber", (), 0),
    (H200, 0, "nvmlDeviceGetIndex", (), 0),
    (H200, 0, "nvmlDeviceGetVbiosVersion", (), "96.00.A5.00.1A"),
    (H200, 0, "nvmlDeviceGetBoardPartNumber", (), "692-2G520-0282-001"),
    (H200, 0, "nvmlDeviceGetMigMode", (), [0, 0]),
    (H200, 0, "nvmlDeviceGetComputeMode", (), pynvml.NVML_COMPUTEMODE_DEFAULT),
    (H200, 0, "nvmlDeviceGetPersistenceMode", (), 1),
    (H200, 0, "nvmlDeviceGetDisplayActive", (), 0),
    (H200, 0, "nvmlDeviceGetCudaComputeCapability", (), (9, 0)),
    (H200, 0, "nvmlDeviceGetArchitecture", (), pynvml.NVML_DEVICE_ARCH_HOPPER),
    (A100, 0, "nvmlDeviceGetName", (), "NVIDIA A100-SXM4-80GB"),
    (A100, 0, "nvmlDeviceGetUUID", (), A100_UUID),
    (A100, 0, "nvmlDeviceGetSerial", (), "1650522003820"),
    (A100, 0, "nvmlDeviceGetMinorNumber", (), 1),
    (A100, 0, "nvmlDeviceGetVbiosVersion", (), "92.00.36.00.02"),
    (A100, 0, "nvmlDeviceGetBoardPartNumber", (), "692-2G506-0212-002"),
    (A100, 0, "nvmlDeviceGetMigMode", (), [1, 1]),
    (A100, 0, "nvmlDeviceGetPersistenceMode", (), 0),
    (A100, 0, "nvmlDeviceGetDisplayMode", (), 1),
    (A100, 0, "nvmlDeviceGetCudaComputeCapability", (), (8, 0)),
    (A100, 0, "nvmlDeviceGetArchitecture", (), pynvml.NVML_DEVICE_ARCH_AMPERE),
    (A5000, 0, "nvmlDeviceGetName", (), "NVIDIA RTX A5000"),
    (A5000, 0, "nvmlDeviceGetUUID", (), "GPU-12345678-aaaa-bbbb-cccc-0123456789ab"),
    (A5000, 0, "nvmlDeviceGetSerial", (), "0123456789012"),
    (A5000, 0, "nvmlDeviceGetMinorNumber", (), 1),  # NVML index 0 is /dev/nvidia1 on this host
    (A5000, 0, "nvmlDeviceGetIndex", (), 0),
    (A5000, 0, "nvmlDeviceGetCudaComputeCapability", (), (8, 6)),
    (A5000, 1, "nvmlDeviceGetUUID", (), "GPU-12345678-aaaa-bbbb-cccc-0123456789cd"),
    (A5000, 1, "nvmlDeviceGetSerial", (), "1234567890123"),
    (A5000, 1, "nvmlDeviceGetMinorNumber", (), 0),
    (A5000, 1, "nvmlDeviceGetIndex", (), 1),
    (A5000, 1, "nvmlDeviceGetBoardPartNumber", (), "900-5G132-1700-000"),
    (T4, 0, "nvmlDeviceGetName", (), "Tesla T4"),
    (T4, 0, "nvmlDeviceGetUUID", (), "GPU-d37e67a5-91dd-3774-a5cb-99096249601a"),
    (T4, 0, "nvmlDeviceGetMinorNumber", (), 0),
    (T4, 0, "nvmlDeviceGetVbiosVersion", (), "90.04.84.00.06"),
    (T4, 0, "nvmlDeviceGetDisplayMode", (), 0),
    (T4, 0, "nvmlDeviceGetCudaComputeCapability", (), (7, 5)),
    (T4, 0, "nvmlDeviceGetArchitecture", (), pynvml.NVML_DEVICE_ARCH_TURING),
])
def test_identity(capture: Path, gpu: int, name: str, args: tuple[Any, ...], expected: Any) -> None:
    assert call(opened(capture), gpu, name, *args) == expected


@pytest.mark.parametrize(("capture", "driver", "cuda", "nvml_version", "count"), [
    (H200, "580.159.04", 13000, "13.580.159.04", 1),
    (A100, "535.54.03", 12020, "12.535.54.03", 1),  # attached_gpus says 4; the file holds one <gpu>
    (A5000, "590.44.01", 13010, "13.590.44.01", 2),
    (T4, "515.105.01", 11070, "11.515.105.01", 1),
])
def test_system(capture: Path, driver: str, cuda: int, nvml_version: str, count: int) -> None:
    nvml = opened(capture)
    assert nvml.nvmlSystemGetDriverVersion() == driver
    assert nvml.nvmlSystemGetCudaDriverVersion() == cuda
    assert nvml.nvmlSystemGetNVMLVersion() == nvml_version
    assert nvml.nvmlDeviceGetCount() == count
    assert (nvml.source, nvml.path) == ("replay", capture)


@pytest.mark.parametrize(("capture", "gpu", "bus_id", "legacy", "domain", "bus", "device", "device_id", "subsys"), [
    (H200, 0, "00000000:00:06.0", "0000:00:06.0", 0, 0x00, 0x06, 0x233510DE, 0x18BF10DE),
    (A100, 0, "00000000:01:00.0", "0000:01:00.0", 0, 0x01, 0x00, 0x20B210DE, 0x147F10DE),
    (A5000, 0, "00000000:81:00.0", "0000:81:00.0", 0, 0x81, 0x00, 0x223110DE, 0x147E10DE),
    (A5000, 1, "00000000:C1:00.0", "0000:C1:00.0", 0, 0xC1, 0x00, 0x223110DE, 0x147E10DE),
    (T4, 0, "00000000:00:1E.0", "0000:00:1E.0", 0, 0x00, 0x1E, 0x1EB810DE, 0x12A210DE),
])
def test_pci_info(capture: Path, gpu: int, bus_id: str, legacy: str, domain: int, bus: int, device: int,
                  device_id: int, subsys: int) -> None:
    nvml = opened(capture)
    for name in ("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v3"):
        info = call(nvml, gpu, name)
        assert isinstance(info, pynvml.nvmlPciInfo_t)
        assert (info.busId, info.busIdLegacy, info.domain, info.bus, info.device, info.pciDeviceId,
                info.pciSubSystemId) == (bus_id, legacy, domain, bus, device, device_id, subsys)
    assert address(nvml.nvmlDeviceGetHandleByPciBusId(bus_id)) == address(nvml.nvmlDeviceGetHandleByIndex(gpu))
    assert address(nvml.nvmlDeviceGetHandleByPciBusId(legacy.lower().encode())) == \
        address(nvml.nvmlDeviceGetHandleByIndex(gpu))


# -- readings ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("capture", "gpu", "total", "reserved", "used", "free"), [
    (H200, 0, 143771, 616, 0, 143156),
    (A100, 0, 81920, 869, 50, 80999),
    (A5000, 0, 24564, 450, 22437, 1678),
    (A5000, 1, 24564, 450, 17253, 6862),
    (T4, 0, 15360, 388, 1032, 13939),
])
def test_memory_info(capture: Path, gpu: int, total: int, reserved: int, used: int, free: int) -> None:
    nvml = opened(capture)
    v2 = call(nvml, gpu, "nvmlDeviceGetMemoryInfo", pynvml.nvmlMemory_v2)
    assert isinstance(v2, pynvml.c_nvmlMemory_v2_t)
    assert (v2.version, v2.total, v2.reserved, v2.used, v2.free) == (
        pynvml.nvmlMemory_v2, total * MIB, reserved * MIB, used * MIB, free * MIB)
    v1 = call(nvml, gpu, "nvmlDeviceGetMemoryInfo")
    assert isinstance(v1, pynvml.c_nvmlMemory_t)
    assert (v1.total, v1.free, v1.used) == (total * MIB, free * MIB, (total - free) * MIB)  # v1 counts reserved
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        call(nvml, gpu, "nvmlDeviceGetMemoryInfo", 0x01000018)


@pytest.mark.parametrize(("capture", "gpu", "total", "used", "free"), [
    (H200, 0, 262144, 1, 262143), (A100, 0, 131072, 1, 131071), (A5000, 1, 256, 5, 251), (T4, 0, 256, 5, 251),
])
def test_bar1_memory(capture: Path, gpu: int, total: int, used: int, free: int) -> None:
    bar1 = call(opened(capture), gpu, "nvmlDeviceGetBAR1MemoryInfo")
    assert (bar1.bar1Total, bar1.bar1Used, bar1.bar1Free) == (total * MIB, used * MIB, free * MIB)


SM, MEM, GR, VID = pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM, pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_VIDEO
CORR, UNC = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOL, AGG = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
TX, RX = pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES


@pytest.mark.parametrize(("capture", "gpu", "name", "args", "expected"), [
    # power (mW): v13 average_power_draw, v12/v11 power_draw; limits v12+ current/requested, v11 enforced/power_limit
    (H200, 0, "nvmlDeviceGetPowerUsage", (), 126360),
    (A100, 0, "nvmlDeviceGetPowerUsage", (), 67030),
    (A5000, 0, "nvmlDeviceGetPowerUsage", (), 6410),
    (A5000, 1, "nvmlDeviceGetPowerUsage", (), 13600),
    (T4, 0, "nvmlDeviceGetPowerUsage", (), 26780),
    (H200, 0, "nvmlDeviceGetEnforcedPowerLimit", (), 700000),
    (A100, 0, "nvmlDeviceGetEnforcedPowerLimit", (), 500000),
    (A5000, 1, "nvmlDeviceGetEnforcedPowerLimit", (), 230000),
    (T4, 0, "nvmlDeviceGetEnforcedPowerLimit", (), 70000),
    (H200, 0, "nvmlDeviceGetPowerManagementLimit", (), 700000),
    (T4, 0, "nvmlDeviceGetPowerManagementLimit", (), 70000),
    (A100, 0, "nvmlDeviceGetPowerManagementDefaultLimit", (), 500000),
    (H200, 0, "nvmlDeviceGetPowerManagementLimitConstraints", (), [200000, 700000]),
    (T4, 0, "nvmlDeviceGetPowerManagementLimitConstraints", (), [60000, 70000]),
    # temperature (C)
    (H200, 0, "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,), 35),
    (A100, 0, "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,), 27),
    (A5000, 0, "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,), 13),
    (A5000, 1, "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,), 15),
    (T4, 0, "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,), 40),
    # clocks (MHz)
    (H200, 0, "nvmlDeviceGetClockInfo", (SM,), 1980),
    (H200, 0, "nvmlDeviceGetClockInfo", (MEM,), 3201),
    (H200, 0, "nvmlDeviceGetClockInfo", (VID,), 1545),
    (A100, 0, "nvmlDeviceGetClockInfo", (GR,), 1275),
    (A100, 0, "nvmlDeviceGetClockInfo", (MEM,), 1593),
    (A5000, 1, "nvmlDeviceGetClockInfo", (SM,), 210),
    (A5000, 1, "nvmlDeviceGetClockInfo", (MEM,), 405),
    (A5000, 1, "nvmlDeviceGetClockInfo", (VID,), 555),
    (T4, 0, "nvmlDeviceGetClockInfo", (SM,), 585),
    (T4, 0, "nvmlDeviceGetClockInfo", (MEM,), 5000),
    (H200, 0, "nvmlDeviceGetMaxClockInfo", (SM,), 1980),
    (A100, 0, "nvmlDeviceGetMaxClockInfo", (SM,), 1410),
    (A100, 0, "nvmlDeviceGetMaxClockInfo", (VID,), 1290),
    (A5000, 0, "nvmlDeviceGetMaxClockInfo", (MEM,), 8001),
    (A5000, 0, "nvmlDeviceGetMaxClockInfo", (GR,), 2100),
    (T4, 0, "nvmlDeviceGetMaxClockInfo", (MEM,), 5001),
    (T4, 0, "nvmlDeviceGetMaxClockInfo", (VID,), 1470),
    # performance state and clock event reasons (v11 T4: clocks_throttle_reasons)
    (H200, 0, "nvmlDeviceGetPerformanceState", (), 0),
    (A5000, 0, "nvmlDeviceGetPerformanceState", (), 8),
    (T4, 0, "nvmlDeviceGetPerformanceState", (), 0),
    (H200, 0, "nvmlDeviceGetCurrentClocksEventReasons", (), pynvml.nvmlClocksEventReasonGpuIdle),
    (H200, 0, "nvmlDeviceGetCurrentClocksThrottleReasons", (), pynvml.nvmlClocksThrottleReasonGpuIdle),
    (A100, 0, "nvmlDeviceGetCurrentClocksEventReasons", (), 0),
    (A5000, 1, "nvmlDeviceGetCurrentClocksEventReasons", (), pynvml.nvmlClocksEventReasonGpuIdle),
    (T4, 0, "nvmlDeviceGetCurrentClocksThrottleReasons", (), 0),
    # utilisation (%), encoder/decoder [%, sampling period us]
    (H200, 0, "nvmlDeviceGetEncoderUtilization", (), [0, 100000]),
    (A5000, 1, "nvmlDeviceGetDecoderUtilization", (), [0, 100000]),
    (T4, 0, "nvmlDeviceGetEncoderUtilization", (), [0, 100000]),
    # ECC
    (H200, 0, "nvmlDeviceGetEccMode", (), [1, 1]),
    (A100, 0, "nvmlDeviceGetEccMode", (), [1, 1]),
    (A5000, 0, "nvmlDeviceGetEccMode", (), [0, 0]),
    (T4, 0, "nvmlDeviceGetEccMode", (), [1, 1]),
    (H200, 0, "nvmlDeviceGetTotalEccErrors", (CORR, VOL), 0),
    (H200, 0, "nvmlDeviceGetTotalEccErrors", (UNC, AGG), 0),
    (A100, 0, "nvmlDeviceGetTotalEccErrors", (UNC, VOL), 0),
    (T4, 0, "nvmlDeviceGetTotalEccErrors", (CORR, AGG), 0),
    (H200, 0, "nvmlDeviceGetRemappedRows", (), (0, 0, 0, 0)),
    (A5000, 1, "nvmlDeviceGetRemappedRows", (), (0, 0, 0, 0)),
    (T4, 0, "nvmlDeviceGetRetiredPages", (pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,), []),
    # PCIe
    (H200, 0, "nvmlDeviceGetCurrPcieLinkGeneration", (), 5),
    (H200, 0, "nvmlDeviceGetMaxPcieLinkGeneration", (), 5),
    (H200, 0, "nvmlDeviceGetCurrPcieLinkWidth", (), 16),
    (H200, 0, "nvmlDeviceGetPcieReplayCounter", (), 3),
    (H200, 0, "nvmlDeviceGetPcieThroughput", (TX,), 884),
    (H200, 0, "nvmlDeviceGetPcieThroughput", (RX,), 422),
    (A100, 0, "nvmlDeviceGetPcieThroughput", (TX,), 4000),
    (A5000, 0, "nvmlDeviceGetCurrPcieLinkGeneration", (), 1),
    (A5000, 0, "nvmlDeviceGetMaxPcieLinkGeneration", (), 4),
    (A5000, 1, "nvmlDeviceGetPcieThroughput", (RX,), 488),
    (T4, 0, "nvmlDeviceGetCurrPcieLinkWidth", (), 8),
    (T4, 0, "nvmlDeviceGetMaxPcieLinkWidth", (), 16),
    (T4, 0, "nvmlDeviceGetMaxPcieLinkGeneration", (), 3),
    # fan (%)
    (A5000, 0, "nvmlDeviceGetFanSpeed", (), 30),
])
def test_readings(capture: Path, gpu: int, name: str, args: tuple[Any, ...], expected: Any) -> None:
    assert call(opened(capture), gpu, name, *args) == expected


@pytest.mark.parametrize(("capture", "gpu", "gpu_util", "mem_util"), [(H200, 0, 0, 0), (A5000, 1, 0, 0), (T4, 0, 0, 0)])
def test_utilization_rates(capture: Path, gpu: int, gpu_util: int, mem_util: int) -> None:
    rates = call(opened(capture), gpu, "nvmlDeviceGetUtilizationRates")
    assert isinstance(rates, pynvml.c_nvmlUtilization_t)
    assert (rates.gpu, rates.memory) == (gpu_util, mem_util)


@pytest.mark.parametrize(("capture", "gpu", "field", "ret", "value"), [
    (H200, 0, pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_SUCCESS, 36),
    (A100, 0, pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_SUCCESS, 44),
    (A5000, 0, pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_ERROR_NOT_SUPPORTED, 0),  # <memory_temp>N/A
    (T4, 0, pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_ERROR_NOT_SUPPORTED, 0),
    (H200, 0, pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_SUCCESS, 126320),
    (A100, 0, pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_SUCCESS, 67030),
    (A100, 0, pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_ERROR_NOT_SUPPORTED, 0),
    (H200, 0, pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, pynvml.NVML_ERROR_NOT_SUPPORTED, 0),
])
def test_field_values(capture: Path, gpu: int, field: int, ret: int, value: int) -> None:
    values = call(opened(capture), gpu, "nvmlDeviceGetFieldValues", [field, (field, 0)])
    assert len(values) == 2
    for v in values:
        assert isinstance(v, pynvml.c_nvmlFieldValue_t)
        assert (v.fieldId, v.nvmlReturn, v.valueType, v.value.uiVal) == (
            field, ret, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, value)


@pytest.mark.parametrize(("capture", "gpu", "name", "args", "error"), [
    (H200, 0, "nvmlDeviceGetFanSpeed", (), pynvml.NVMLError_NotSupported),
    (H200, 0, "nvmlDeviceGetRetiredPages", (0,), pynvml.NVMLError_NotSupported),  # H200 remaps rows instead
    (H200, 0, "nvmlDeviceGetDisplayMode", (), pynvml.NVMLError_Deprecated),  # "Requested functionality has been…"
    (H200, 0, "nvmlDeviceGetGpuInstanceId", (), pynvml.NVMLError_NotSupported),
    (H200, 0, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", (), pynvml.NVMLError_InvalidArgument),
    (H200, 0, "nvmlDeviceGetTemperature", (1,), pynvml.NVMLError_InvalidArgument),  # 1: a sensor NVML lacks
    (H200, 0, "nvmlDeviceGetClockInfo", (7,), pynvml.NVMLError_InvalidArgument),
    (H200, 0, "nvmlDeviceGetSamples", (8, 0), pynvml.NVMLError_NotSupported),  # 8: JPG samples
    (A100, 0, "nvmlDeviceGetUtilizationRates", (), pynvml.NVMLError_NotSupported),  # MIG on: N/A
    (A100, 0, "nvmlDeviceGetEncoderUtilization", (), pynvml.NVMLError_NotSupported),
    (A100, 0, "nvmlDeviceGetSamples", (pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0), pynvml.NVMLError_NotSupported),
    (A100, 0, "nvmlDeviceGetRemappedRows", (), pynvml.NVMLError_NotSupported),  # <remapped_rows>N/A
    (A100, 0, "nvmlDeviceGetFanSpeed", (), pynvml.NVMLError_NotSupported),
    (A5000, 0, "nvmlDeviceGetMigMode", (), pynvml.NVMLError_NotSupported),
    (A5000, 1, "nvmlDeviceGetTotalEccErrors", (CORR, VOL), pynvml.NVMLError_NotSupported),  # ECC disabled
    (A5000, 1, "nvmlDeviceGetDisplayMode", (), pynvml.NVMLError_Deprecated),
    (T4, 0, "nvmlDeviceGetBoardPartNumber", (), pynvml.NVMLError_NotSupported),  # no element in v11
    (T4, 0, "nvmlDeviceGetRemappedRows", (), pynvml.NVMLError_NotSupported),
    (T4, 0, "nvmlDeviceGetMigMode", (), pynvml.NVMLError_NotSupported),
    (T4, 0, "nvmlDeviceGetMaxMigDeviceCount", (), None),  # not an error: 0
])
def test_not_supported(capture: Path, gpu: int, name: str, args: tuple[Any, ...], error: type | None) -> None:
    nvml = opened(capture)
    if error is None:
        assert call(nvml, gpu, name, *args) == 0
        return
    with pytest.raises(error):
        call(nvml, gpu, name, *args)


# -- processes -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("capture", "gpu", "name", "expected"), [
    (H200, 0, "nvmlDeviceGetComputeRunningProcesses", []),
    (A100, 0, "nvmlDeviceGetComputeRunningProcesses", []),
    (A5000, 0, "nvmlDeviceGetComputeRunningProcesses", [(100477, 22430 * MIB, NA, NA)]),
    (A5000, 1, "nvmlDeviceGetComputeRunningProcesses", [(100477, 17246 * MIB, NA, NA)]),
    (A5000, 1, "nvmlDeviceGetGraphicsRunningProcesses", []),
    (T4, 0, "nvmlDeviceGetComputeRunningProcesses", [(5762, 1005 * MIB, NA, NA)]),
    (T4, 0, "nvmlDeviceGetGraphicsRunningProcesses", [(675, 22 * MIB, NA, NA)]),
    (T4, 0, "nvmlDeviceGetMPSComputeRunningProcesses", []),
])
def test_processes(capture: Path, gpu: int, name: str, expected: list[tuple[int, int, int, int]]) -> None:
    procs = call(opened(capture), gpu, name)
    assert all(isinstance(p, pynvml.nvmlFriendlyObject) for p in procs)
    assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in procs] == expected


# -- the H200 capture against what real NVML answered on the same machine (nvml_probe.json) ---------
PROBE_CALLS = [
    ("GetName", "nvmlDeviceGetName", ()),
    ("GetUUID", "nvmlDeviceGetUUID", ()),
    ("GetSerial", "nvmlDeviceGetSerial", ()),
    ("GetMinorNumber", "nvmlDeviceGetMinorNumber", ()),
    ("GetIndex", "nvmlDeviceGetIndex", ()),
    ("GetEnforcedPowerLimit", "nvmlDeviceGetEnforcedPowerLimit", ()),
    ("GetMaxClockInfo_SM", "nvmlDeviceGetMaxClockInfo", (SM,)),
    ("GetClockInfo_MEM", "nvmlDeviceGetClockInfo", (MEM,)),
    ("GetPerformanceState", "nvmlDeviceGetPerformanceState", ()),
    ("GetPersistenceMode", "nvmlDeviceGetPersistenceMode", ()),
    ("GetComputeMode", "nvmlDeviceGetComputeMode", ()),
    ("GetDisplayActive", "nvmlDeviceGetDisplayActive", ()),
    ("GetEccMode", "nvmlDeviceGetEccMode", ()),
    ("GetTotalEccErrors_volatile_corrected", "nvmlDeviceGetTotalEccErrors", (CORR, VOL)),
    ("GetTotalEccErrors_aggregate_uncorrected", "nvmlDeviceGetTotalEccErrors", (UNC, AGG)),
    ("GetRemappedRows", "nvmlDeviceGetRemappedRows", ()),
    ("GetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrentClocksThrottleReasons", ()),
    ("GetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkGeneration", ()),
    ("GetCurrPcieLinkWidth", "nvmlDeviceGetCurrPcieLinkWidth", ()),
    ("GetPcieReplayCounter", "nvmlDeviceGetPcieReplayCounter", ()),
    ("GetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses", ()),
    ("GetGraphicsRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses", ()),
    ("GetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses", ()),
    ("GetMigMode", "nvmlDeviceGetMigMode", ()),
    ("GetCudaComputeCapability", "nvmlDeviceGetCudaComputeCapability", ()),
    ("GetArchitecture", "nvmlDeviceGetArchitecture", ()),
    ("GetVbiosVersion", "nvmlDeviceGetVbiosVersion", ()),
    ("GetBoardPartNumber", "nvmlDeviceGetBoardPartNumber", ()),
    ("GetEncoderUtilization", "nvmlDeviceGetEncoderUtilization", ()),
    ("GetDecoderUtilization", "nvmlDeviceGetDecoderUtilization", ()),
]


def probe() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PROBE.read_text())
    return data


@pytest.mark.parametrize(("key", "name", "args"), PROBE_CALLS)
def test_h200_agrees_with_probe(key: str, name: str, args: tuple[Any, ...]) -> None:
    expected = ast.literal_eval(probe()["calls"][f"idle:{key}"]["value"])
    assert call(opened(H200), 0, name, *args) == expected


def test_h200_pci_bus_id_and_system_agree_with_probe() -> None:
    p, nvml = probe(), opened(H200)
    assert call(nvml, 0, "nvmlDeviceGetPciInfo").busId == ast.literal_eval(p["calls"]["idle:GetPciInfo"]["value"])
    assert (nvml.nvmlSystemGetDriverVersion(), nvml.nvmlSystemGetNVMLVersion(), nvml.nvmlSystemGetCudaDriverVersion(),
            nvml.nvmlDeviceGetCount()) == (p["driver"], p["nvml_version"], p["cuda_driver_version"], p["count"])


@pytest.mark.parametrize(("key", "name", "args"), [
    ("GetFanSpeed", "nvmlDeviceGetFanSpeed", ()),
    ("GetRetiredPages", "nvmlDeviceGetRetiredPages", (0,)),
    ("GetProcessUtilization", "nvmlDeviceGetProcessUtilization", (0,)),
])
def test_h200_errors_agree_with_probe(key: str, name: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(pynvml.NVMLError) as exc:
        call(opened(H200), 0, name, *args)
    assert str(exc.value) == probe()["errors"][f"idle:{key}"]


def test_busy_h200_scenario_agrees_with_probe() -> None:
    p, nvml = probe(), opened(SCENARIOS / "h200_busy.toml")
    busy = {k.removeprefix("busy:"): v["value"] for k, v in p["calls"].items() if k.startswith("busy:")}
    for key, name, args in [("GetPowerUsage", "nvmlDeviceGetPowerUsage", ()),
                            ("GetTemperature", "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,)),
                            ("GetClockInfo_SM", "nvmlDeviceGetClockInfo", (SM,)),
                            ("GetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrentClocksThrottleReasons", ())]:
        assert call(nvml, 0, name, *args) == ast.literal_eval(busy[key]), key
    procs = call(nvml, 0, "nvmlDeviceGetComputeRunningProcesses")
    assert [{"pid": q.pid, "usedGpuMemory": q.usedGpuMemory} for q in procs] == p["busy_procs"]
    assert [s.pid for s in call(nvml, 0, "nvmlDeviceGetProcessUtilization", 0)] == [463]


# -- MIG (A100 capture: 4 instances, GPU instances 3-6, no MIG UUIDs in the XML) -------------------
@pytest.mark.parametrize(("slot", "gi"), [(0, 3), (1, 4), (2, 5), (3, 6)])
def test_a100_mig_devices(slot: int, gi: int) -> None:
    nvml = opened(A100)
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
    assert bool(nvml.nvmlDeviceIsMigDeviceHandle(mig)) and not nvml.nvmlDeviceIsMigDeviceHandle(parent)
    assert nvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1  # pynvml returns the ctypes.c_uint itself
    assert address(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)) == address(parent)
    assert (nvml.nvmlDeviceGetGpuInstanceId(mig), nvml.nvmlDeviceGetComputeInstanceId(mig)) == (gi, 0)
    assert nvml.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-80GB MIG 1g.20gb"  # 14 SMs, 19968 of 81920 MiB
    uuid = nvml.nvmlDeviceGetUUID(mig)
    assert uuid == mig_uuid(A100_UUID, gi, 0)
    assert re.fullmatch(r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid)
    assert address(nvml.nvmlDeviceGetHandleByUUID(uuid)) == address(mig)
    mem = nvml.nvmlDeviceGetMemoryInfo(mig, version=pynvml.nvmlMemory_v2)
    assert (mem.total, mem.reserved, mem.used, mem.free) == (19968 * MIB, 0, 12 * MIB, 19955 * MIB)
    bar1 = nvml.nvmlDeviceGetBAR1MemoryInfo(mig)
    assert (bar1.bar1Total, bar1.bar1Used) == (32767 * MIB, 0)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(mig) == []
    assert nvml.nvmlDeviceGetPciInfo(mig).busId == "00000000:01:00.0"


def test_a100_mig_uuids_are_distinct_and_stable() -> None:
    uuids = [open_replay(A100) for _ in range(2)]
    got = []
    for nvml in uuids:
        nvml.nvmlInit()
        parent = nvml.nvmlDeviceGetHandleByIndex(0)
        got.append([nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, i)) for i in range(4)])
    assert got[0] == got[1] and len(set(got[0])) == 4


@pytest.mark.parametrize(("slot", "error"), [
    (4, pynvml.NVMLError_NotFound), (6, pynvml.NVMLError_NotFound), (7, pynvml.NVMLError_InvalidArgument),
    (-1, pynvml.NVMLError_InvalidArgument),
])
def test_a100_empty_mig_slots(slot: int, error: type) -> None:
    nvml = opened(A100)
    with pytest.raises(error):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), slot)


@pytest.mark.parametrize(("name", "args"), [
    ("nvmlDeviceGetUtilizationRates", ()), ("nvmlDeviceGetSamples", (pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)),
    ("nvmlDeviceGetProcessUtilization", (0,)), ("nvmlDeviceGetEncoderUtilization", ()),
    ("nvmlDeviceGetPowerUsage", ()), ("nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,)),
    ("nvmlDeviceGetClockInfo", (SM,)), ("nvmlDeviceGetMigMode", ()), ("nvmlDeviceGetMinorNumber", ()),
    ("nvmlDeviceGetMaxMigDeviceCount", ()),
])
def test_a100_mig_device_calls_not_supported(name: str, args: tuple[Any, ...]) -> None:
    nvml = opened(A100)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        getattr(nvml, name)(mig, *args)


def test_scenario_mig_instances_and_processes(tmp_path: Path) -> None:
    nvml = opened(scenario(tmp_path, """
        [[gpu]]
        capture = "@H200"
        [[gpu.mig]]
        gpu_instance_id = 1
        profile = "3g.71gb"
        memory_total_bytes = 76235669504
        uuid = "MIG-11111111-2222-3333-4444-555555555555"
        [[gpu.mig.process]]
        pid = 900
        used_memory_bytes = 1073741824
        [[gpu.mig]]
        gpu_instance_id = 2
        compute_instance_id = 1
        profile = "1g.18gb"
        memory_total_bytes = 17716740096
        [[gpu.process]]
        pid = 901
    """))
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(parent) == [1, 1]
    first, second = (nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, i) for i in (0, 1))
    assert nvml.nvmlDeviceGetName(first) == "NVIDIA H200 MIG 3g.71gb"
    assert nvml.nvmlDeviceGetUUID(first) == "MIG-11111111-2222-3333-4444-555555555555"
    assert nvml.nvmlDeviceGetUUID(second) == mig_uuid(H200_UUID, 2, 1)
    assert nvml.nvmlDeviceGetComputeInstanceId(second) == 1
    mem = nvml.nvmlDeviceGetMemoryInfo(first, version=pynvml.nvmlMemory_v2)
    assert (mem.total, mem.used, mem.free) == (76235669504, 1 << 30, 76235669504 - (1 << 30))
    procs = [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in nvml.nvmlDeviceGetComputeRunningProcesses(first)]
    assert procs == [(900, 1, 0)]
    assert nvml.nvmlDeviceGetComputeRunningProcesses(second) == []
    everything = nvml.nvmlDeviceGetComputeRunningProcesses(parent)
    assert sorted((p.pid, p.gpuInstanceId) for p in everything) == [(900, 1), (901, NA)]


# -- NVML behaviour: init, samples, process utilisation, energy --------------------------------------
@pytest.mark.parametrize(("name", "args"), [
    ("nvmlDeviceGetCount", ()), ("nvmlSystemGetDriverVersion", ()), ("nvmlDeviceGetHandleByIndex", (0,)),
    ("nvmlDeviceGetHandleByUUID", (H200_UUID,)), ("nvmlShutdown", ()),
])
def test_uninitialized_before_init(name: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        getattr(open_replay(H200), name)(*args)


def test_init_is_reference_counted() -> None:
    nvml = open_replay(H200)
    nvml.nvmlInit()
    nvml.nvmlInitWithFlags(pynvml.NVML_INIT_FLAG_NO_GPUS)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetName(handle) == "NVIDIA H200"  # one reference left
    nvml.nvmlShutdown()
    for fn in (lambda: nvml.nvmlDeviceGetName(handle), nvml.nvmlDeviceGetCount, nvml.nvmlShutdown):
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            fn()


@pytest.mark.parametrize(("arg", "error"), [
    (1, pynvml.NVMLError_InvalidArgument), (-1, pynvml.NVMLError_InvalidArgument),
])
def test_handle_by_index_out_of_range(arg: int, error: type) -> None:
    with pytest.raises(error):
        opened(H200).nvmlDeviceGetHandleByIndex(arg)


@pytest.mark.parametrize("handle", [None, 0, "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"])
def test_foreign_handles_are_invalid(handle: Any) -> None:
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        opened(H200).nvmlDeviceGetName(handle)


def test_a_handle_no_replay_gave_out_is_invalid() -> None:
    nvml = opened(H200)
    stray = ctypes.create_string_buffer(8)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetName(ctypes.cast(stray, pynvml.c_nvmlDevice_t))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetName(pynvml.c_nvmlDevice_t())  # NULL


def test_handle_by_uuid() -> None:
    nvml = opened(A5000)
    assert nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(b"GPU-12345678-aaaa-bbbb-cccc-0123456789cd")) == 1
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


@pytest.mark.parametrize(("sampling_type", "value"), [
    (pynvml.NVML_GPU_UTILIZATION_SAMPLES, 87), (pynvml.NVML_MEMORY_UTILIZATION_SAMPLES, 41),
    (pynvml.NVML_TOTAL_POWER_SAMPLES, 126360), (pynvml.NVML_PROCESSOR_CLK_SAMPLES, 1980),
])
def test_samples_newer_than_timestamp(tmp_path: Path, sampling_type: int, value: int) -> None:
    clock = FakeClock(1_000.0)
    nvml = opened(scenario(tmp_path, """
        [[gpu]]
        capture = "@H200"
        [gpu.override]
        util_gpu_percent = 87
        util_memory_percent = 41
    """), clock=clock)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    value_type, samples = nvml.nvmlDeviceGetSamples(h, sampling_type, 0)
    assert value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert len(samples) == 120  # a full buffer: 20 s at 6 Hz
    assert all(isinstance(s, pynvml.c_nvmlSample_t) and s.sampleValue.uiVal == value for s in samples)
    stamps = [s.timeStamp for s in samples]
    assert stamps == sorted(stamps) and stamps[-1] <= 1_000_000_000 and stamps[1] - stamps[0] == 166_666
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the newest sample yet
        nvml.nvmlDeviceGetSamples(h, sampling_type, stamps[-1])
    clock.now += 0.5
    assert len(nvml.nvmlDeviceGetSamples(h, sampling_type, stamps[-1])[1]) == 3
    clock.now += 3600
    assert len(nvml.nvmlDeviceGetSamples(h, sampling_type, stamps[-1])[1]) == 120


def test_process_utilization(tmp_path: Path) -> None:
    clock = FakeClock(2_000.0)
    nvml = opened(scenario(tmp_path, """
        [[gpu]]
        capture = "@H200"
        [[gpu.process]]
        pid = 463
        used_memory_bytes = 1050673152
        sm_utilization_percent = 35
        [[gpu.process]]
        pid = 464
        type = "graphics"
    """), clock=clock)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    [sample] = nvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert isinstance(sample, pynvml.c_nvmlProcessUtilizationSample_t)
    assert (sample.pid, sample.timeStamp, sample.smUtil, sample.memUtil) == (463, 2_000_000_000, 35, 0)
    with pytest.raises(pynvml.NVMLError_NotFound):  # no process ran since that timestamp
        nvml.nvmlDeviceGetProcessUtilization(h, sample.timeStamp)
    clock.now += 1  # six samples later (one per 1/6 s, on the µs grid from nvmlInit)
    assert nvml.nvmlDeviceGetProcessUtilization(h, sample.timeStamp)[0].timeStamp == 2_000_000_000 + 6 * 166_666
    assert [p.pid for p in nvml.nvmlDeviceGetGraphicsRunningProcesses(h)] == [464]
    assert [p.usedGpuMemory for p in nvml.nvmlDeviceGetGraphicsRunningProcesses(h)] == [None]


def test_energy_grows_at_captured_power() -> None:
    clock = FakeClock(5_000.0)
    nvml = opened(H200, clock=clock)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(h) == 0
    clock.now += 10
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(h) == 1_263_600  # 126360 mW x 10 s
    clock.now -= 5  # a wall-clock step back never makes the counter go down
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(h) == 1_263_600


# -- pynvml module emulation --------------------------------------------------------------------------
@pytest.mark.parametrize("name", [
    "NVML_TEMPERATURE_GPU", "NVML_CLOCK_SM", "NVML_GPU_UTILIZATION_SAMPLES", "nvmlMemory_v2", "NVMLError",
    "NVMLError_NotSupported", "NVMLError_GpuIsLost", "nvmlClocksEventReasonGpuIdle", "NVML_FI_DEV_MEMORY_TEMP",
    "c_nvmlMemory_t",
])
def test_constants_come_from_pynvml(name: str) -> None:
    assert getattr(open_replay(H200), name) is getattr(pynvml, name)


@pytest.mark.parametrize("name", ["nvmlDeviceGetNumGpuCores", "nvmlDeviceGetNvLinkVersion"])
def test_exported_functions_without_an_answer_are_not_supported_and_counted(name: str) -> None:
    nvml = opened(H200)
    before = nvml.library.unanswered[name]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        getattr(nvml, name)(nvml.nvmlDeviceGetHandleByIndex(0), *([0] if "NvLink" in name else []))
    assert nvml.library.unanswered[name] == before + 1


def test_error_strings_come_from_the_library() -> None:
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "GPU is lost"
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH) == "Argument version mismatch"


# -- faults ---------------------------------------------------------------------------------------------
SET = object()  # in the argument tables below: a new event set of the replay under test (with_sets)
SAMPLE, METRICS = object(), object()  # a new GPM sample; an nvmlGpmMetricsGet_t (with_sets)
XID = pynvml.nvmlEventTypeXidCriticalError
# Arguments after the handle for every implemented device call; a fault naming the call must fail it.
DEVICE_CALL_ARGS: dict[str, tuple[Any, ...]] = {
    "nvmlDeviceGetClockInfo": (SM,), "nvmlDeviceGetMaxClockInfo": (SM,), "nvmlDeviceGetFieldValues": ([82],),
    "nvmlDeviceGetMemoryInfo": (), "nvmlDeviceGetMigDeviceHandleByIndex": (0,), "nvmlDeviceGetPcieThroughput": (TX,),
    "nvmlDeviceGetProcessUtilization": (0,), "nvmlDeviceGetRetiredPages": (0,),
    "nvmlDeviceGetSamples": (pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0),
    "nvmlDeviceGetTemperature": (pynvml.NVML_TEMPERATURE_GPU,), "nvmlDeviceGetTotalEccErrors": (CORR, VOL),
    "nvmlDeviceRegisterEvents": (XID, SET), "nvmlDeviceGetNvLinkState": (0,),
    "nvmlDeviceGetNvLinkErrorCounter": (0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY), "nvmlGpmSampleGet": (SAMPLE,),
    "nvmlGpmMigSampleGet": (1, SAMPLE),
}
# Calls that name no GPU (faults without `gpu`), with all their arguments.
SYSTEM_CALLS = {"nvmlInit": (), "nvmlInitWithFlags": (0,), "nvmlShutdown": (), "nvmlSystemGetDriverVersion": (),
                "nvmlSystemGetCudaDriverVersion": (), "nvmlSystemGetNVMLVersion": (), "nvmlDeviceGetCount": (),
                "nvmlDeviceGetHandleByIndex": (0,), "nvmlDeviceGetHandleByUUID": (H200_UUID,),
                "nvmlDeviceGetHandleByPciBusId": ("00000000:00:06.0",), "nvmlEventSetCreate": (),
                "nvmlEventSetFree": (SET,), "nvmlEventSetWait_v2": (SET, 0), "nvmlEventSetWait": (SET, 0),
                "nvmlGpmSampleAlloc": (), "nvmlGpmSampleFree": (SAMPLE,), "nvmlGpmMetricsGet": (METRICS,)}


def with_sets(nvml: ReplayedNVML, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with each SET replaced by a new event set of ``nvml``, each SAMPLE by a new GPM sample
    and METRICS by an nvmlGpmMetricsGet_t of one metric between two new (unfilled) samples."""
    def one(a: Any) -> Any:
        if a is SET:
            return nvml.nvmlEventSetCreate()
        if a is SAMPLE:
            return nvml.nvmlGpmSampleAlloc()
        if a is METRICS:
            mg = pynvml.c_nvmlGpmMetricsGet_t()
            mg.version, mg.numMetrics = pynvml.NVML_GPM_METRICS_GET_VERSION, 1
            mg.sample1, mg.sample2 = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
            return mg
        return a
    return tuple(one(a) for a in args)


@pytest.mark.parametrize("name", sorted(IMPLEMENTED_CALLS))
def test_every_call_can_be_faulted(tmp_path: Path, name: str) -> None:
    gpu = "" if name in SYSTEM_CALLS else "gpu = 0"
    nvml = open_replay(scenario(tmp_path, f"""
        [[gpu]]
        capture = "@H200"
        [[fault]]
        {gpu}
        call = "{name}"
        error = "UNKNOWN"
        after_calls = {2 if name == "nvmlDeviceGetSamples" else 1}
    """))  # pynvml's nvmlDeviceGetSamples makes two C calls: the count, then the samples
    for _ in range({"nvmlInit": 0, "nvmlInitWithFlags": 0, "nvmlShutdown": 2}.get(name, 1)):
        nvml.nvmlInit()
    if name in SYSTEM_CALLS:
        args = with_sets(nvml, SYSTEM_CALLS[name])
        fn: Callable[[], Any] = lambda: getattr(nvml, name)(*args)  # noqa: E731
    else:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        args = with_sets(nvml, DEVICE_CALL_ARGS.get(name, ()))
        fn = lambda: getattr(nvml, name)(handle, *args)  # noqa: E731
    try:
        fn()  # after_calls = 1: the first call is not failed (it may still raise NOT_SUPPORTED)
    except pynvml.NVMLError as exc:
        assert not isinstance(exc, pynvml.NVMLError_Unknown)
    with pytest.raises(pynvml.NVMLError_Unknown):
        fn()


@pytest.mark.parametrize(("after_calls", "times", "outcomes"), [
    (0, None, "xxxxx"),
    (2, None, "..xxx"),
    (0, 1, "x...."),
    (2, 3, "..xxx."),
    (1, 0, "....."),
])
def test_fault_after_calls_and_times(tmp_path: Path, after_calls: int, times: int | None, outcomes: str) -> None:
    nvml = opened(scenario(tmp_path, f"""
        [[gpu]]
        capture = "@A5000"
        [[gpu]]
        capture = "@A5000"
        capture_index = 1
        [[fault]]
        gpu = 1
        call = "nvmlDeviceGetMemoryInfo"
        error = "GPU_IS_LOST"
        after_calls = {after_calls}
        {"" if times is None else f"times = {times}"}
    """))
    healthy, faulty = (nvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    got = ""
    for _ in outcomes:
        try:
            nvml.nvmlDeviceGetMemoryInfo(faulty)
            got += "."
        except pynvml.NVMLError_GpuIsLost:
            got += "x"
        assert nvml.nvmlDeviceGetMemoryInfo(healthy).total == 24564 * MIB  # the other GPU never fails
    assert got == outcomes


@pytest.mark.parametrize(("error", "exc_type"), [
    ("LIBRARY_NOT_FOUND", pynvml.NVMLError_LibraryNotFound),
    ("DRIVER_NOT_LOADED", pynvml.NVMLError_DriverNotLoaded),
    ("LIB_RM_VERSION_MISMATCH", pynvml.NVMLError_LibRmVersionMismatch),
])
def test_system_fault_on_init(tmp_path: Path, error: str, exc_type: type) -> None:
    nvml = open_replay(scenario(tmp_path, f"""
        [[gpu]]
        capture = "@H200"
        [[fault]]
        call = "nvmlInit"
        error = "{error}"
        times = 2
    """))
    for _ in range(2):
        with pytest.raises(exc_type):
            nvml.nvmlInit()
        with pytest.raises(pynvml.NVMLError_Uninitialized):  # a failed init leaves NVML uninitialised
            nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()  # a driver installed later is picked up by the retry
    assert nvml.nvmlDeviceGetCount() == 1


def test_fault_on_every_call_of_one_gpu(tmp_path: Path) -> None:
    nvml = opened(scenario(tmp_path, """
        [[gpu]]
        capture = "@H200"
        [[gpu]]
        capture = "@H200"
        uuid = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c11"
        minor = 1
        [[fault]]
        gpu = 1
        call = "*"
        error = "GPU_IS_LOST"
        after_calls = 20
    """))
    lost = nvml.nvmlDeviceGetHandleByIndex(1)
    for _ in range(19):
        nvml.nvmlDeviceGetName(lost)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetPowerUsage(lost)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetPowerUsage(nvml.nvmlDeviceGetHandleByIndex(0)) == 126360
    assert nvml.nvmlDeviceGetCount() == 2


@pytest.mark.parametrize(("error", "answers"), [("TIMEOUT", False), (None, True)])
def test_fault_hangs_then_fails_or_answers(tmp_path: Path, error: str | None, answers: bool) -> None:
    nvml = opened(scenario(tmp_path, f"""
        [[gpu]]
        capture = "@H200"
        [[fault]]
        gpu = 0
        call = "nvmlDeviceGetTemperature"
        {"" if error is None else f'error = "{error}"'}
        hang_seconds = 0.05
        times = 1
    """))
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    start = time.monotonic()
    if answers:
        assert nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 35
    else:
        with pytest.raises(pynvml.NVMLError_Timeout):
            nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    assert time.monotonic() - start >= 0.05
    start = time.monotonic()
    assert nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 35  # times = 1: no more hang
    assert time.monotonic() - start < 0.05


# -- scenario overrides -----------------------------------------------------------------------------------
def test_scenario_identity_overrides_and_order(tmp_path: Path) -> None:
    nvml = opened(scenario(tmp_path, """
        [[gpu]]
        capture = "@A5000"
        index = 1
        [[gpu]]
        capture = "@A5000"
        capture_index = 1
        index = 0
        minor = 7
        uuid = "GPU-00000000-1111-2222-3333-444444444444"
        name = "NVIDIA RTX A5000 (replayed)"
        pci_bus_id = "0000:3b:00.0"
    """))
    first = nvml.nvmlDeviceGetHandleByIndex(0)
    assert (nvml.nvmlDeviceGetIndex(first), nvml.nvmlDeviceGetMinorNumber(first), nvml.nvmlDeviceGetUUID(first),
            nvml.nvmlDeviceGetName(first)) == (0, 7, "GPU-00000000-1111-2222-3333-444444444444",
                                               "NVIDIA RTX A5000 (replayed)")
    pci = nvml.nvmlDeviceGetPciInfo(first)
    assert (pci.busId, pci.domain, pci.bus, pci.device) == ("00000000:3B:00.0", 0, 0x3B, 0)
    assert nvml.nvmlDeviceGetSerial(first) == "1234567890123"  # the rest is capture_index 1's
    second = nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetUUID(second) == "GPU-12345678-aaaa-bbbb-cccc-0123456789ab"


def test_scenario_reading_overrides_and_process_merge(tmp_path: Path) -> None:
    nvml = opened(scenario(tmp_path, """
        [[gpu]]
        capture = "@A5000"
        [gpu.override]
        temp_gpu_c = 80
        fan_speed_percent = "N/A"
        [[gpu.process]]
        pid = 100477
        used_memory_bytes = 1024
        sm_utilization_percent = 90
        [[gpu.process]]
        pid = 5
        type = "mps"
    """))
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 80
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetFanSpeed(h)
    assert [(p.pid, p.usedGpuMemory) for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)] == [(100477, 1024)]
    assert [p.pid for p in nvml.nvmlDeviceGetMPSComputeRunningProcesses(h)] == [5]
    assert nvml.nvmlDeviceGetPowerUsage(h) == 6410  # not overridden: the capture's


def test_scenario_capture_path_is_relative_to_the_toml(tmp_path: Path) -> None:
    (tmp_path / "captures").mkdir()
    shutil.copy(T4, tmp_path / "captures" / "t4.xml")
    path = tmp_path / "t4.toml"
    path.write_text('[[gpu]]\ncapture = "captures/t4.xml"\n')
    assert call(opened(path), 0, "nvmlDeviceGetName") == "Tesla T4"


def test_doctype_is_never_fetched(tmp_path: Path) -> None:
    """An entity defined only in the DTD the DOCTYPE names stays undefined: the DTD is not read."""
    (tmp_path / "evil.dtd").write_text('<!ENTITY drv "from-the-dtd">')
    path = tmp_path / "capture.xml"
    path.write_text('<?xml version="1.0" ?>\n<!DOCTYPE nvidia_smi_log SYSTEM "evil.dtd">\n'
                    "<nvidia_smi_log>\n<driver_version>&drv;</driver_version>\n</nvidia_smi_log>\n")
    with pytest.raises(ReplayError, match=r"capture\.xml: line 4, column \d+: not well-formed XML \(undefined entity"):
        open_replay(path)


# -- bad input: every message names the file and the line/column or the key ------------------------------
@pytest.mark.parametrize(("name", "text", "message"), [
    ("bad.xml", "<nvidia_smi_log>\n  <gpu>\n</nvidia_smi_log>\n",
     r"bad\.xml: line 3, column 3: not well-formed XML \(mismatched tag\)"),
    ("empty.xml", "", r"empty\.xml: line 1, column 1: not well-formed XML \(no element found\)"),
    ("other.xml", "<foo/>", r"other\.xml: root element is <foo>, expected <nvidia_smi_log>"),
    ("bad.toml", '[[gpu]]\ncapture = \n', r"bad\.toml: line 2, column 11: not valid TOML \(Invalid value\)"),
    ("eod.toml", '[[gpu]]\ncapture = "x', r"eod\.toml: line 2, column 13: not valid TOML \(Unterminated string\)"),
    ("top.toml", "gpus = []\n", r"top\.toml: gpus: unknown key 'gpus'"),
    ("key.toml", '[[gpu]]\ncapture = "@H200"\ncolour = 1\n', r"key\.toml: gpu\[0\]\.colour: unknown key 'colour'"),
    ("nocap.toml", "[[gpu]]\nindex = 0\n", r"nocap\.toml: gpu\[0\]\.capture: missing required key"),
    ("missing.toml", '[[gpu]]\ncapture = "nope.xml"\n',
     r"missing\.toml: gpu\[0\]\.capture: capture file .*nope\.xml does not exist"),
    ("range.toml", '[[gpu]]\ncapture = "@H200"\ncapture_index = 1\n',
     r"range\.toml: gpu\[0\]\.capture_index: .*nvidia-smi-q\.xml holds 1 <gpu> element\(s\); index 1 is out of range"),
    ("type.toml", '[[gpu]]\ncapture = "@H200"\n[[gpu.process]]\npid = "x"\n',
     r"type\.toml: gpu\[0\]\.process\[0\]\.pid: expected int, got 'x'"),
    ("ptype.toml", '[[gpu]]\ncapture = "@H200"\n[[gpu.process]]\npid = 1\ntype = "cuda"\n',
     r"ptype\.toml: gpu\[0\]\.process\[0\]\.type: expected 'compute', 'graphics' or 'mps', got 'cuda'"),
    ("override.toml", '[[gpu]]\ncapture = "@H200"\n[gpu.override]\nwattage = 1\n',
     r"override\.toml: gpu\[0\]\.override\.wattage: unknown key 'wattage'"),
    ("dup.toml", '[[gpu]]\ncapture = "@H200"\n[[gpu]]\ncapture = "@H200"\n',
     r"dup\.toml: gpu\[1\]\.uuid: uuid 'GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10' is also gpu\[0\]'s"),
    ("index.toml", '[[gpu]]\ncapture = "@H200"\nindex = 3\n', r"index\.toml: gpu: gpu indices \[3\] are not 0\.\.0"),
    ("pci.toml", '[[gpu]]\ncapture = "@H200"\npci_bus_id = "06.0"\n', r"pci\.toml: gpu\[0\]\.pci_bus_id: expected"),
    ("err.toml", '[[gpu]]\ncapture = "@H200"\n[[fault]]\ncall = "nvmlInit"\nerror = "GPU_ON_FIRE"\n',
     r"err\.toml: fault\[0\]\.error: unknown NVML error 'GPU_ON_FIRE'"),
    ("call.toml", '[[gpu]]\ncapture = "@H200"\n[[fault]]\ncall = "nvmlDeviceGetFoo"\nerror = "UNKNOWN"\n',
     r"call\.toml: fault\[0\]\.call: 'nvmlDeviceGetFoo' is not a call the replay implements"),
    ("fgpu.toml", '[[gpu]]\ncapture = "@H200"\n[[fault]]\ngpu = 1\ncall = "*"\nerror = "UNKNOWN"\n',
     r"fgpu\.toml: fault\[0\]\.gpu: no GPU with NVML index 1"),
    ("noerr.toml", '[[gpu]]\ncapture = "@H200"\n[[fault]]\ncall = "nvmlInit"\n',
     r"noerr\.toml: fault\[0\]\.error: a fault needs `error`, `hang_seconds` or both"),
    ("neg.toml", '[[gpu]]\ncapture = "@H200"\n[[fault]]\ncall = "nvmlInit"\nerror = "UNKNOWN"\nafter_calls = -1\n',
     r"neg\.toml: fault\[0\]\.after_calls: must not be negative"),
    # process timelines (accounting scenarios)
    ("nan.toml", '[[gpu]]\ncapture = "@H200"\n[[gpu.process]]\npid = 1\n[[gpu.process.step]]\nat_s = nan\n',
     r"nan\.toml: gpu\[0\]\.process\[0\]\.step\[0\]\.at_s: must be a number of seconds from 0 to .*, got nan"),
    ("inf.toml", '[[gpu]]\ncapture = "@H200"\n[[gpu.process]]\npid = 1\nend_s = inf\n',
     r"inf\.toml: gpu\[0\]\.process\[0\]\.end_s: must be a number of seconds"),
    ("ends.toml", '[[gpu]]\ncapture = "@H200"\n[[gpu.process]]\npid = 1\nstart_s = 5\nend_s = 2\n',
     r"ends\.toml: gpu\[0\]\.process\[0\]\.end_s: need start_s < end_s, got 5\.0 and 2\.0"),
    ("order.toml", '[[gpu]]\ncapture = "@H200"\n[[gpu.process]]\npid = 1\n[[gpu.process.step]]\nat_s = 5\n'
     '[[gpu.process.step]]\nat_s = 2\n',
     r"order\.toml: gpu\[0\]\.process\[0\]\.step\[1\]\.at_s: steps must be in time order, got 2\.0 after 5\.0"),
    ("twice.toml", '[[gpu]]\ncapture = "@H200"\n[[gpu.process]]\npid = 1\n[[gpu.process]]\npid = 1\n',
     r"twice\.toml: gpu\[0\]\.process: PID 1 is given twice as a compute process on this GPU"),
])
def test_bad_input(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(ReplayError, match=message) as exc:
        open_replay(scenario(tmp_path, text, name))
    assert isinstance(exc.value, ValueError) and str(tmp_path / name) in str(exc.value)


def test_bad_capture_named_by_a_scenario(tmp_path: Path) -> None:
    (tmp_path / "broken.xml").write_text("<nvidia_smi_log>\n<gpu>\n")
    path = scenario(tmp_path, '[[gpu]]\ncapture = "broken.xml"\n')
    with pytest.raises(ReplayError, match=r"scenario\.toml: gpu\[0\]\.capture: bad capture: .*broken\.xml: "
                                          r"line 3, column 1: not well-formed XML \(no element found\)"):
        open_replay(path)


def test_missing_files(tmp_path: Path) -> None:
    for name in ("gone.xml", "gone.toml"):
        with pytest.raises(ReplayError, match=rf"cannot read .*{name}"):
            open_replay(tmp_path / name)


# -- inputs NVML could not have produced: rejected at load, or answered as NOT_SUPPORTED ------------------
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
FAULT = '[[gpu]]\ncapture = "@H200"\n[[fault]]\ncall = "nvmlInit"\nerror = "UNKNOWN"\n'
OVERRIDE = '[[gpu]]\ncapture = "@H200"\n[gpu.override]\n'
PROCESS = '[[gpu]]\ncapture = "@H200"\n[[gpu.process]]\n'
MIG = '[[gpu]]\ncapture = "@A100"\n[[gpu.mig]]\nprofile = "1g.10gb"\n'


@pytest.mark.parametrize(("text", "message"), [
    # hang_seconds: finite, 0..a year (time.sleep raises OverflowError from ~9.2e9 s)
    (FAULT + "hang_seconds = inf\n", r"fault\[0\]\.hang_seconds: must be a finite number of seconds.*got inf"),
    (FAULT + "hang_seconds = nan\n", r"fault\[0\]\.hang_seconds: must be a finite number of seconds.*got nan"),
    (FAULT + "hang_seconds = -inf\n", r"fault\[0\]\.hang_seconds: must not be negative, got -inf"),
    (FAULT + "hang_seconds = -0.5\n", r"fault\[0\]\.hang_seconds: must not be negative, got -0\.5"),
    (FAULT + "hang_seconds = 1e300\n",
     r"fault\[0\]\.hang_seconds: must be a finite number of seconds, at most 31536000, got 1e\+300"),
    (FAULT + 'hang_seconds = "5"\n', r"fault\[0\]\.hang_seconds: expected a number, got '5'"),
    # after_calls / times: non-negative integers
    (FAULT + "times = -1\n", r"fault\[0\]\.times: must not be negative, got -1"),
    (FAULT + "times = 1.5\n", r"fault\[0\]\.times: expected int, got 1\.5"),
    (FAULT + "after_calls = inf\n", r"fault\[0\]\.after_calls: expected int, got inf"),
    (FAULT + "after_calls = true\n", r"fault\[0\]\.after_calls: expected int, got True"),
    # integers beyond NVML's C types: unsigned long long (bytes), unsigned int (everything else)
    (OVERRIDE + "memory_total_bytes = 99999999999999999999\n",
     r"gpu\[0\]\.override\.memory_total_bytes: must be at most 18446744073709551615 \(NVML answers it as an "
     r"unsigned long long\), got 99999999999999999999"),
    (OVERRIDE + f"memory_free_bytes = {U64 + 1}\n", r"gpu\[0\]\.override\.memory_free_bytes: must be at most"),
    (OVERRIDE + f"temp_gpu_c = {U32 + 1}\n",
     r"gpu\[0\]\.override\.temp_gpu_c: must be at most 4294967295 \(NVML answers it as an unsigned int\)"),
    (OVERRIDE + "temp_gpu_c = -36\n", r"gpu\[0\]\.override\.temp_gpu_c: must not be negative, got -36"),
    (OVERRIDE + "clock_sm_mhz = -1980\n", r"gpu\[0\]\.override\.clock_sm_mhz: must not be negative"),
    (OVERRIDE + "power_usage_mw = 1.5\n", r"gpu\[0\]\.override\.power_usage_mw: expected int, got 1\.5"),
    (OVERRIDE + "minor = 4294967296\n", r"gpu\[0\]\.override\.minor: must be at most 4294967295"),
    ('[[gpu]]\ncapture = "@H200"\nminor = 4294967296\n', r"gpu\[0\]\.minor: must be at most 4294967295"),
    (PROCESS + "pid = 4294967296\n", r"gpu\[0\]\.process\[0\]\.pid: must be at most 4294967295"),
    (PROCESS + "pid = -1\n", r"gpu\[0\]\.process\[0\]\.pid: must not be negative"),
    (PROCESS + f"pid = 1\nused_memory_bytes = {U64 + 1}\n",
     r"gpu\[0\]\.process\[0\]\.used_memory_bytes: must be at most 18446744073709551615"),
    (PROCESS + f"pid = 1\nused_memory_bytes = {U64}\n",
     r"gpu\[0\]\.process\[0\]\.used_memory_bytes: 18446744073709551615 is NVML_VALUE_NOT_AVAILABLE"),
    (PROCESS + "pid = 1\nused_memory_bytes = -1\n", r"gpu\[0\]\.process\[0\]\.used_memory_bytes: must not be negative"),
    (MIG + f"gpu_instance_id = {U32 + 1}\nmemory_total_bytes = 1\n",
     r"gpu\[0\]\.mig\[0\]\.gpu_instance_id: must be at most 4294967295"),
    (MIG + f"gpu_instance_id = 1\nmemory_total_bytes = {U64 + 1}\n",
     r"gpu\[0\]\.mig\[0\]\.memory_total_bytes: must be at most 18446744073709551615"),
    (MIG + f"gpu_instance_id = 1\nmemory_total_bytes = 1\n[[gpu.mig.process]]\npid = 1\nused_memory_bytes = {U64 - 1}\n"
     f"[[gpu.mig.process]]\npid = 2\nused_memory_bytes = {U64 - 1}\n",
     r"gpu\[0\]\.mig\[0\]\.process: its processes use 36893488147419103228 bytes"),
    # NVML always has a UUID
    ('[[gpu]]\ncapture = "@H200"\nuuid = ""\n', r"gpu\[0\]\.uuid: a GPU always has a UUID in NVML, got ''"),
    ('[[gpu]]\ncapture = "@H200"\nuuid = "  "\n', r"gpu\[0\]\.uuid: a GPU always has a UUID in NVML"),
    (OVERRIDE + 'uuid = "N/A"\n', r"gpu\[0\]\.override\.uuid: a GPU always has a UUID in NVML, got 'N/A'"),
    (OVERRIDE + 'pci_bus_id = "06.0"\n', r"gpu\[0\]\.override\.pci_bus_id: expected DOMAIN:BUS:DEVICE\.FUNCTION"),
    # the capture: missing, a directory, a path through a file, a NUL character
    ('[[gpu]]\ncapture = "."\n', r"gpu\[0\]\.capture: capture file .* is not a file \(a directory\)"),
    ('[[gpu]]\ncapture = "@H200/x.xml"\n', r"gpu\[0\]\.capture: cannot read capture file .*x\.xml: Not a directory"),
    ('[[gpu]]\ncapture = "a\\u0000.xml"\n', r"gpu\[0\]\.capture: cannot read capture file .*embedded null"),
    # TOML that tomllib parses into something other than a TOMLDecodeError
    ("a = " + "1" * 5000 + "\n", r"not valid TOML \(Exceeds the limit \(4300 digits\)"),
    ("a = " + "[" * 5000 + "]" * 5000 + "\n", r"not valid TOML \(arrays or tables nested too deeply\)"),
])
def test_scenario_values_out_of_range(tmp_path: Path, text: str, message: str) -> None:
    path = scenario(tmp_path, text)
    with pytest.raises(ReplayError, match=message) as exc:
        open_replay(path)
    assert str(path) in str(exc.value)


def test_scenario_accepts_the_extremes_of_the_c_types(tmp_path: Path) -> None:
    nvml = opened(scenario(tmp_path, OVERRIDE + f"memory_total_bytes = {U64}\nmemory_free_bytes = {U64}\n"
                           f"temp_gpu_c = {U32}\n[[gpu.process]]\npid = {U32}\nused_memory_bytes = {U64 - 1}\n"
                           '[[fault]]\ngpu = 0\ncall = "nvmlDeviceGetName"\nhang_seconds = 31536000\n'
                           f"after_calls = {U64 + 1}\n"))
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert (nvml.nvmlDeviceGetMemoryInfo(h).total, nvml.nvmlDeviceGetTemperature(h, 0)) == (U64, U32)
    assert [(p.pid, p.usedGpuMemory) for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)] == [(U32, U64 - 1)]


def test_scenario_override_replaces_an_invalid_or_deprecated_cell(tmp_path: Path) -> None:
    (tmp_path / "t4.xml").write_bytes(edited(T4, {"temperature/gpu_temp": "-36 C"}))
    nvml = opened(scenario(tmp_path, '[[gpu]]\ncapture = "t4.xml"\n[gpu.override]\ntemp_gpu_c = 40\n'
                                     '[[gpu]]\ncapture = "@H200"\nminor = 1\n[gpu.override]\ndisplay_mode = "N/A"\n'))
    assert nvml.capture.gpus[0].invalid == frozenset() and call(nvml, 0, "nvmlDeviceGetTemperature", 0) == 40
    with pytest.raises(pynvml.NVMLError_NotSupported):  # "N/A" over a deprecated cell: N/A, not DEPRECATED
        call(nvml, 1, "nvmlDeviceGetDisplayMode")


def test_memory_info_v1_used_never_wraps(tmp_path: Path) -> None:
    nvml = opened(scenario(tmp_path, OVERRIDE + "memory_total_bytes = 10\nmemory_free_bytes = 20\n"))
    assert call(nvml, 0, "nvmlDeviceGetMemoryInfo").used == 0


# -- events: nvmlEventSet*, nvmlDeviceRegisterEvents, scenario [[gpu.xid]] -------------------------------
SBE, DBE, PSTATE = (pynvml.nvmlEventTypeSingleBitEccError, pynvml.nvmlEventTypeDoubleBitEccError,
                    pynvml.nvmlEventTypePState)
PAIR_GPUS = ('capture = "@A5000"', 'capture = "@A5000"\ncapture_index = 1')  # ECC off on both


def xid_scenario(events: list[tuple[int, str]], gpus: tuple[str, ...] = PAIR_GPUS) -> str:
    """``[[gpu]]`` tables (``gpus``: their keys), each followed by the ``[[gpu.xid]]`` tables
    ``events`` give it: (NVML index, the table's keys)."""
    return "".join(f"[[gpu]]\n{keys}\n" + "".join(f"[[gpu.xid]]\n{xid}\n" for gpu, xid in events if gpu == i)
                   for i, keys in enumerate(gpus))


class FakeTime(FakeClock):
    """A clock and a sleep that moves it (and records what it was asked to sleep)."""

    def __init__(self, now: float = 1_000.0) -> None:
        super().__init__(now)
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def with_events(tmp_path: Path, events: list[tuple[int, str]], time_: FakeTime | None = None,
                gpus: tuple[str, ...] = PAIR_GPUS, extra: str = "") -> ReplayedNVML:
    """The replay of :func:`xid_scenario` (plus ``extra`` top-level tables), initialised."""
    kwargs = {} if time_ is None else {"clock": time_, "sleep": time_.sleep}
    return opened(scenario(tmp_path, xid_scenario(events, gpus) + extra), **kwargs)


def waited(nvml: ReplayedNVML, es: Any, timeoutms: int, name: str = "nvmlEventSetWait_v2") -> tuple[int, int] | str:
    """(NVML index, XID) of the event nvmlEventSetWait_v2 (or ``name``) delivers, or "timeout"."""
    try:
        data = getattr(nvml, name)(es, timeoutms)
    except pynvml.NVMLError_Timeout:
        return "timeout"
    assert data.eventType == XID and (data.gpuInstanceId, data.computeInstanceId) == (NA, NA)
    return nvml.nvmlDeviceGetIndex(data.device), data.eventData


def test_xid_79_on_gpu_1_after_1_s_is_delivered_once(tmp_path: Path) -> None:
    # the event falls due 1 s after the scenario is opened: generous, as a loaded machine is slow here
    start = time.monotonic()
    nvml = with_events(tmp_path, [(1, "xid = 79\nat_s = 1.0")])
    gpus = [nvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1)]
    es = nvml.nvmlEventSetCreate()
    for h in gpus:
        nvml.nvmlDeviceRegisterEvents(h, XID, es)
    began = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):  # not due yet: blocks the whole 50 ms, then TIMEOUT
        nvml.nvmlEventSetWait_v2(es, 50)
    assert time.monotonic() - began >= 0.05
    data = nvml.nvmlEventSetWait_v2(es, 5000)  # returns when it falls due, not after 5 s
    assert 1.0 <= time.monotonic() - start < 3.0
    assert isinstance(data, pynvml.c_nvmlEventData_t)  # pynvml's own structure, filled through the C ABI
    assert address(data.device) == address(gpus[1])
    assert (data.eventType, data.eventData, data.gpuInstanceId, data.computeInstanceId) == (XID, 79, NA, NA)
    assert pynvml.nvmlStructToFriendlyObject(data).eventData == 79
    start = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):  # delivered once
        nvml.nvmlEventSetWait(es, 100)
    assert time.monotonic() - start >= 0.1


# (registrations: (NVML index, event types) on one set, then waits of 1 s each: what each returns)
@pytest.mark.parametrize(("registrations", "outcomes"), [
    ([], ["timeout"]),                                              # nothing registered
    ([(0, PSTATE)], ["timeout"]),                                   # another type
    ([(0, XID)], [(0, 48), "timeout", "timeout"]),                  # GPU 0 only
    ([(1, XID)], [(1, 79), (1, 31), "timeout"]),
    ([(1, XID | PSTATE), (0, XID)], [(0, 48), (1, 79), (1, 31), "timeout"]),  # earliest due first
    ([(0, XID), (0, XID)], [(0, 48), "timeout"]),                   # registering twice: still once
])
def test_only_registered_events_are_delivered(tmp_path: Path, registrations: list[tuple[int, int]],
                                              outcomes: list[Any]) -> None:
    t = FakeTime()
    nvml = with_events(tmp_path, [(1, "xid = 79\nat_s = 0.2"), (1, "xid = 31\nat_s = 0.2"), (0, "xid = 48")], t)
    es = nvml.nvmlEventSetCreate()
    for gpu, types in registrations:
        call(nvml, gpu, "nvmlDeviceRegisterEvents", types, es)
    assert [waited(nvml, es, 1000) for _ in outcomes] == outcomes


@pytest.mark.parametrize(("delay", "timeoutms", "outcome", "slept"), [
    (0.0, 0, "timeout", 0.0),       # timeout 0: a poll
    (0.0, 150, "timeout", 0.15),    # blocks the whole timeout
    (0.0, 250, (1, 79), 0.2),       # ... or until the event falls due
    (0.2, 0, (1, 79), 0.0),         # already due
    (0.5, 0, (1, 79), 0.0),
    (0.1, 60, "timeout", 0.06),
    (0.1, 120, (1, 79), 0.1),
])
def test_wait_blocks_until_due_or_timeout(tmp_path: Path, delay: float, timeoutms: int, outcome: Any,
                                          slept: float) -> None:
    t = FakeTime()
    nvml = open_replay(scenario(tmp_path, xid_scenario([(1, "xid = 79\nat_s = 0.2")])), clock=t, sleep=t.sleep)
    t.now += 30  # at_s counts from the first nvmlInit, not from loading
    nvml.nvmlInit()
    es = nvml.nvmlEventSetCreate()
    call(nvml, 1, "nvmlDeviceRegisterEvents", XID, es)
    t.now += delay
    assert waited(nvml, es, timeoutms) == outcome
    assert sum(t.slept) == pytest.approx(slept, abs=0.002) and all(0 < s <= 0.05 for s in t.slept)


def test_sets_share_an_event_that_happens_while_they_listen(tmp_path: Path) -> None:
    t = FakeTime()
    nvml = with_events(tmp_path, [(0, "xid = 13"), (0, "xid = 94\nat_s = 1")], t)
    t.now += 0.5
    first, second = nvml.nvmlEventSetCreate(), nvml.nvmlEventSetCreate()
    for es in (first, second):
        call(nvml, 0, "nvmlDeviceRegisterEvents", XID, es)
    # XID 13 was due at init, before anyone listened: the first set that waits takes it
    assert [waited(nvml, second, 0), waited(nvml, first, 0)] == [(0, 13), "timeout"]
    # XID 94 falls due while both listen: both get it, once each
    assert [waited(nvml, first, 2000), waited(nvml, second, 0)] == [(0, 94), (0, 94)]
    assert [waited(nvml, first, 0), waited(nvml, second, 0)] == ["timeout", "timeout"]
    late = nvml.nvmlEventSetCreate()  # e.g. a watcher restarted: nothing is delivered twice
    call(nvml, 0, "nvmlDeviceRegisterEvents", XID, late)
    assert waited(nvml, late, 0) == "timeout"


def test_mig_instance_ids_of_an_event(tmp_path: Path) -> None:
    nvml = with_events(tmp_path, [(0, "xid = 43\ngpu_instance_id = 4"),
                                  (0, "xid = 31\ngpu_instance_id = 5\ncompute_instance_id = 0"), (0, "xid = 79")],
                       gpus=('capture = "@A100"',))
    es = nvml.nvmlEventSetCreate()
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceRegisterEvents(parent, XID, es)
    got = [nvml.nvmlEventSetWait_v2(es, 0) for _ in range(3)]
    assert [(address(d.device), d.eventData, d.gpuInstanceId, d.computeInstanceId) for d in got] == [
        (address(parent), 43, 4, NA), (address(parent), 31, 5, 0), (address(parent), 79, NA, NA)]


@pytest.mark.parametrize(("capture", "gpu", "supported"), [
    (H200, 0, PSTATE | XID | SBE | DBE), (A100, 0, PSTATE | XID | SBE | DBE), (T4, 0, PSTATE | XID | SBE | DBE),
    (A5000, 1, PSTATE | XID),  # ECC disabled: no ECC events
])
def test_supported_event_types(capture: Path, gpu: int, supported: int) -> None:
    nvml = opened(capture)
    assert call(nvml, gpu, "nvmlDeviceGetSupportedEventTypes") == supported
    es = nvml.nvmlEventSetCreate()
    call(nvml, gpu, "nvmlDeviceRegisterEvents", supported, es)
    for bit in (SBE, DBE, pynvml.nvmlEventTypeClock, pynvml.nvmlEventMigConfigChange):
        if not bit & supported:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                call(nvml, gpu, "nvmlDeviceRegisterEvents", bit, es)


@pytest.mark.parametrize(("name", "args"), [
    ("nvmlDeviceGetSupportedEventTypes", ()), ("nvmlDeviceRegisterEvents", (XID, SET)),
])
def test_mig_handles_have_no_events(name: str, args: tuple[Any, ...]) -> None:
    nvml = opened(A100)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        getattr(nvml, name)(mig, *with_sets(nvml, args))


def freed(nvml: ReplayedNVML) -> Any:
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlEventSetFree(es)
    return es


def shut(nvml: ReplayedNVML) -> Any:
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlShutdown()
    nvml.nvmlInit()
    return es


_STRAY = ctypes.create_string_buffer(8)  # memory no replay handed out as an event set


# sets that nvmlDeviceRegisterEvents, nvmlEventSetWait_v2 and nvmlEventSetFree answer INVALID_ARGUMENT
@pytest.mark.parametrize("make_set", [
    lambda nvml: None, lambda nvml: pynvml.c_nvmlEventSet_t(),  # NULL
    lambda nvml: ctypes.cast(_STRAY, pynvml.c_nvmlEventSet_t),
    freed,
    shut,  # the last nvmlShutdown frees every set
])
def test_bad_event_sets(make_set: Callable[[ReplayedNVML], Any]) -> None:
    nvml = opened(H200)
    es = make_set(nvml)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    for fn in (lambda: nvml.nvmlDeviceRegisterEvents(h, XID, es), lambda: nvml.nvmlEventSetWait_v2(es, 0),
               lambda: nvml.nvmlEventSetFree(es)):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            fn()


@pytest.mark.parametrize(("fn", "error"), [
    (lambda nvml, h, es: nvml.nvmlDeviceRegisterEvents(h, 0x20, es), pynvml.NVMLError_InvalidArgument),  # no such type
    (lambda nvml, h, es: nvml.nvmlDeviceRegisterEvents(h, 1 << 40, es), pynvml.NVMLError_InvalidArgument),
    (lambda nvml, h, es: nvml.nvmlDeviceRegisterEvents(None, XID, es), pynvml.NVMLError_InvalidArgument),
    (lambda nvml, h, es: nvml.nvmlDeviceRegisterEvents(h, 1.0, es), TypeError),  # as pynvml's c_ulonglong(1.0)
    (lambda nvml, h, es: nvml.nvmlEventSetWait_v2(es, 0.5), TypeError),  # as pynvml's c_uint(0.5)
    (lambda nvml, h, es: nvml.nvmlEventSetWait(es, "1"), TypeError),
])
def test_bad_event_arguments(fn: Callable[[ReplayedNVML, Any, Any], Any], error: type) -> None:
    nvml = opened(H200)
    with pytest.raises(error):
        fn(nvml, nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlEventSetCreate())


@pytest.mark.parametrize(("name", "args"), [
    ("nvmlEventSetCreate", ()), ("nvmlEventSetFree", (pynvml.c_nvmlEventSet_t(),)),
    ("nvmlEventSetWait_v2", (pynvml.c_nvmlEventSet_t(), 0)), ("nvmlEventSetWait", (pynvml.c_nvmlEventSet_t(), 0)),
])
def test_event_calls_before_init(name: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        getattr(open_replay(H200), name)(*args)


@pytest.mark.parametrize(("end", "error"), [
    (lambda nvml, es: nvml.nvmlEventSetFree(es), pynvml.NVMLError_InvalidArgument),
    (lambda nvml, es: nvml.nvmlShutdown(), pynvml.NVMLError_Uninitialized),
])
def test_free_or_shutdown_ends_a_wait_in_another_thread(end: Callable[[ReplayedNVML, Any], Any], error: type) -> None:
    nvml = opened(H200)
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(0), XID, es)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            nvml.nvmlEventSetWait_v2(es, 10_000)
        except pynvml.NVMLError as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    start = time.monotonic()
    end(nvml, es)
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - start < 0.5  # within a 50 ms wait slice
    assert [type(e) for e in raised] == [error]


# (a fault: what nvmlDeviceRegisterEvents on GPU 1, then nvmlEventSetWait_v2(0), nvmlEventSetWait(0) answer)
@pytest.mark.parametrize(("fault", "outcomes"), [
    ('call = "nvmlEventSetWait_v2"\nerror = "UNKNOWN"\ntimes = 1', ["ok", "Unknown", (1, 79)]),
    # pynvml's nvmlEventSetWait calls the nvmlEventSetWait_v2 symbol: a fault on either name hits both
    ('call = "nvmlEventSetWait"\nerror = "GPU_IS_LOST"', ["ok", "GpuIsLost", "GpuIsLost"]),
    ('call = "nvmlEventSetWait_v2"\nerror = "UNKNOWN"', ["ok", "Unknown", "Unknown"]),
    ('gpu = 1\ncall = "*"\nerror = "GPU_IS_LOST"', ["GpuIsLost", "timeout", "timeout"]),  # the wait names no GPU
    ('gpu = 1\ncall = "nvmlDeviceRegisterEvents"\nerror = "UNKNOWN"\ntimes = 1', ["Unknown", "timeout", "timeout"]),
    ('call = "nvmlEventSetWait_v2"\nhang_seconds = 7\ntimes = 1', ["ok", (1, 79), "timeout"]),
])
def test_faults_on_event_calls(tmp_path: Path, fault: str, outcomes: list[Any]) -> None:
    t = FakeTime()
    nvml = with_events(tmp_path, [(1, "xid = 79")], t, extra=f"[[fault]]\n{fault}\n")
    es = nvml.nvmlEventSetCreate()
    got: list[Any] = []
    for fn in (lambda: call(nvml, 1, "nvmlDeviceRegisterEvents", XID, es) or "ok",
               lambda: waited(nvml, es, 0), lambda: waited(nvml, es, 0, "nvmlEventSetWait")):
        try:
            got.append(fn())
        except pynvml.NVMLError as exc:
            got.append(type(exc).__name__.removeprefix("NVMLError_"))
    assert got == outcomes
    assert t.slept == ([7.0] if "hang" in fault else [])  # timeout 0: no sleep but the hang


H200_XID = '[[gpu]]\ncapture = "@H200"\n[[gpu.xid]]\n'
MIG_XID = '[[gpu]]\ncapture = "@A100"\n[[gpu.xid]]\nxid = 79\n'
GPU = '[[gpu]]\ncapture = "@H200"\n'
AT = r"gpu\[0\]\.xid\[0\]"


@pytest.mark.parametrize(("text", "message"), [
    (H200_XID + "at_s = 1\n", AT + r"\.xid: missing required key"),
    (H200_XID + "xid = 0\n", AT + r"\.xid: XIDs are numbered from 1, got 0"),
    (H200_XID + "xid = -79\n", AT + r"\.xid: must not be negative, got -79"),
    (H200_XID + "xid = 79.0\n", AT + r"\.xid: expected int, got 79\.0"),
    (H200_XID + f"xid = {U64 + 1}\n", AT + r"\.xid: must be at most 18446744073709551615 \(NVML answers "
                                  r"it as an unsigned long long\)"),
    (H200_XID + "xid = 79\nat_s = -0.1\n", AT + r"\.at_s: must not be negative, got -0\.1"),
    (H200_XID + "xid = 79\nat_s = inf\n", AT + r"\.at_s: must be a number of seconds from 0 to 3\.1536e\+08, got inf"),
    (H200_XID + "xid = 79\nat_s = nan\n", AT + r"\.at_s: must be a number of seconds"),
    (H200_XID + 'xid = 79\nat_s = "1s"\n', AT + r"\.at_s: expected a number, got '1s'"),
    (H200_XID + "xid = 79\nwhen = 1\n",
     AT + r"\.when: unknown key 'when' \(known: at_s, compute_instance_id, gpu_instance_id, xid\)"),
    (H200_XID + "xid = 79\ngpu_instance_id = 1\n",
     AT + r"\.gpu_instance_id: this GPU has no MIG instance 1 \(MIG is not enabled\)"),
    (MIG_XID + "gpu_instance_id = 1\n",
     AT + r"\.gpu_instance_id: this GPU has no MIG instance 1 \(gpu/compute instance ids: 3/0, 4/0, 5/0, 6/0\)"),
    (MIG_XID + "gpu_instance_id = 3\ncompute_instance_id = 1\n",
     AT + r"\.compute_instance_id: this GPU has no MIG instance 3/1"),
    (MIG_XID + "compute_instance_id = 0\n", AT + r"\.compute_instance_id: given without gpu_instance_id"),
    (GPU + "xid = 1\n", r"gpu\[0\]\.xid: expected an array of tables"),
    (GPU + "lost_at_s = -1\n", r"gpu\[0\]\.lost_at_s: must not be negative, got -1"),
    (GPU + 'lost_at_s = "soon"\n', r"gpu\[0\]\.lost_at_s: expected a number, got 'soon'"),
    (GPU + "errors = 1\n", r"gpu\[0\]\.errors: expected dict, got 1"),
    (GPU + '[gpu.errors]\nnvmlDeviceGetFoo = "UNKNOWN"\n',
     r"gpu\[0\]\.errors\.nvmlDeviceGetFoo: 'nvmlDeviceGetFoo' is not an NVML call the replay answers \(or '\*'\)"),
    (GPU + '[gpu.errors]\nnvmlDeviceGetTemperature = "BROKEN"\n',
     r"gpu\[0\]\.errors\.nvmlDeviceGetTemperature: expected an NVML error name without NVML_ERROR_"),
    (GPU + "[gpu.errors]\nnvmlDeviceGetTemperature = 3\n", r"errors\.nvmlDeviceGetTemperature: expected an NVML error"),
    (GPU + "[gpu.hangs]\nnvmlDeviceGetTemperature = -1\n",
     r"gpu\[0\]\.hangs\.nvmlDeviceGetTemperature: must not be negative, got -1"),
    (GPU + "[gpu.hangs]\nnvmlDeviceGetTemperature = inf\n",
     r"gpu\[0\]\.hangs\.nvmlDeviceGetTemperature: must be a finite number of seconds, at most 31536000, got inf"),
    ('[[event]]\ngpu = 0\nxid = 79\n' + GPU, r"scenario\.toml: event: unknown key 'event'"),
])
def test_bad_device_state(tmp_path: Path, text: str, message: str) -> None:
    path = scenario(tmp_path, text)
    with pytest.raises(ReplayError, match=message) as exc:
        open_replay(path)
    assert str(path) in str(exc.value)


def test_xid_keys_and_defaults(tmp_path: Path) -> None:
    nvml = open_replay(scenario(tmp_path, xid_scenario([(0, "xid = 79"), (0, "xid = 48\nat_s = 31536000"),
                                                        (1, f"xid = {U64}\nat_s = 2")])))
    assert [(gpu, x.xid, x.at_s, x.gpu_instance_id) for gpu, x in events_of(nvml)] == [
        (0, 79, 0.0, None), (0, 48, 31536000.0, None), (1, U64, 2.0, None)]
    assert events_of(open_replay(H200)) == []


# -- files that are not text, or cannot be read ----------------------------------------------------------
def write_bytes(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


@pytest.mark.parametrize(("name", "make", "message"), [
    ("g.toml", write_bytes(b'[[gpu]]\ncapture = "\xff"\n'),
     r"g\.toml: line 2, byte offset 19: not UTF-8 text \(invalid start byte; TOML is UTF-8\)"),
    ("g.toml", write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00"), r"g\.toml: line 1, byte offset 0: not UTF-8 text"),
    ("g.toml", write_bytes("a = 'é'\n".encode("latin-1")), r"g\.toml: line 1, byte offset 5: not UTF-8 text"),
    ("g.toml", write_bytes(b"\xef\xbb\xbfa = 1\n"), r"g\.toml: line 1, column 1: not valid TOML"),  # a BOM
    ("g.xml", write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00"), r"g\.xml: line 1, column 1: not well-formed XML"),
    ("g.xml", write_bytes(b"<nvidia_smi_log>\xff\xfe</nvidia_smi_log>"),
     r"g\.xml: line 1, column 17: not well-formed XML \(not well-formed \(invalid token\)\)"),
    ("g.xml", write_bytes(b'<?xml version="1.0" encoding="utf-32"?><nvidia_smi_log/>'),
     r"g\.xml: line 1: not well-formed XML \(cannot decode it as the encoding its XML declaration names: "
     r"multi-byte encodings are not supported\)"),
    ("g.xml", write_bytes(b'<?xml version="1.0" encoding="rot13"?><nvidia_smi_log/>'),
     r"g\.xml: line 1: not well-formed XML \(cannot decode .*'rot13' is not a text encoding"),
    ("g.xml", write_bytes(b'<?xml version="1.0" encoding="no-such-codec"?><nvidia_smi_log/>'),
     r"g\.xml: line 1: not well-formed XML \(cannot decode .*unknown encoding: no-such-codec"),
    ("g.xml", write_bytes(b'<?xml version="1.0" encoding="idna"?><nvidia_smi_log/>'), r"g\.xml: line 1: "),
    ("g.toml", lambda path: path.mkdir(), r"cannot read scenario .*g\.toml: Is a directory"),
    ("g.xml", lambda path: path.mkdir(), r"cannot read .*g\.xml: Is a directory"),
])
def test_binary_and_unreadable_files(tmp_path: Path, name: str, make: Callable[[Path], None], message: str) -> None:
    path = tmp_path / name
    make(path)
    with pytest.raises(ReplayError, match=message) as exc:
        open_replay(path)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize(("name", "message"), [
    ("g.toml", r"cannot read scenario .*not-a-dir/g\.toml: Not a directory"),
    ("g.xml", r"cannot read .*not-a-dir/g\.xml: Not a directory"),
])
def test_path_through_a_file(tmp_path: Path, name: str, message: str) -> None:
    (tmp_path / "not-a-dir").write_text("")
    with pytest.raises(ReplayError, match=message):
        open_replay(tmp_path / "not-a-dir" / name)


@pytest.mark.parametrize("name", ["g.toml", "g.xml", "a\0b.xml"])
def test_permission_denied_and_nul_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """No permission (simulated: these tests may run as root, who may read anything)."""
    path = tmp_path / name

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(Path, "read_bytes", denied)  # scenarios
    monkeypatch.setattr("xml.etree.ElementTree.parse", denied)  # captures
    with pytest.raises(ReplayError, match="NUL character" if "\0" in name else rf"{name}: Permission denied"):
        open_replay(path)


# -- XML cells NVML's unsigned types cannot hold: NOT_SUPPORTED, listed in GpuCapture.invalid -------------
def edited(capture: Path, cells: dict[str, str], gpu: int = 0) -> bytes:
    """``capture`` with the text of each ``<gpu>``-relative element path in ``cells`` replaced."""
    tree = ET.parse(capture)
    el = tree.getroot().findall("gpu")[gpu]
    for path, text in cells.items():
        node = el.find(path)
        assert node is not None, path
        node.text = text
    return ET.tostring(tree.getroot())


@pytest.mark.parametrize(("cells", "name", "args", "invalid"), [
    ({"temperature/gpu_temp": "-36 C"}, "nvmlDeviceGetTemperature", (0,), {"temp_gpu_c"}),
    ({"temperature/gpu_temp": "4294967296 C"}, "nvmlDeviceGetTemperature", (0,), {"temp_gpu_c"}),
    ({"temperature/gpu_temp": "warm"}, "nvmlDeviceGetTemperature", (0,), {"temp_gpu_c"}),
    ({"temperature/gpu_temp": "9" * 5000 + " C"}, "nvmlDeviceGetTemperature", (0,), {"temp_gpu_c"}),
    ({"clocks/graphics_clock": "-1980 MHz"}, "nvmlDeviceGetClockInfo", (GR,), {"clock_graphics_mhz"}),
    ({"max_clocks/sm_clock": "-1 MHz"}, "nvmlDeviceGetMaxClockInfo", (SM,), {"max_clock_sm_mhz"}),
    ({"fb_memory_usage/total": "-15109 MiB"}, "nvmlDeviceGetMemoryInfo", (), {"memory_total_bytes"}),
    ({"fb_memory_usage/used": "99999999999 GiB"}, "nvmlDeviceGetMemoryInfo", (), {"memory_used_bytes"}),
    ({"bar1_memory_usage/free": "-1 MiB"}, "nvmlDeviceGetBAR1MemoryInfo", (), {"bar1_free_bytes"}),
    ({"power_readings/power_draw": "-26.78 W"}, "nvmlDeviceGetPowerUsage", (), {"power_usage_mw", "power_instant_mw"}),
    ({"power_readings/power_limit": "4294968 W"}, "nvmlDeviceGetPowerManagementLimit", (), {"power_limit_mw"}),
    ({"fan_speed": "-5 %"}, "nvmlDeviceGetFanSpeed", (), {"fan_speed_percent"}),
    ({"utilization/gpu_util": "-1 %"}, "nvmlDeviceGetUtilizationRates", (), {"util_gpu_percent"}),
    ({"minor_number": "-1"}, "nvmlDeviceGetMinorNumber", (), {"minor"}),
    ({"pci/replay_counter": "-3"}, "nvmlDeviceGetPcieReplayCounter", (), {"pcie_replay_counter"}),
    ({"pci/tx_util": "-1 KB/s"}, "nvmlDeviceGetPcieThroughput", (TX,), {"pcie_tx_kbps"}),
    ({"pci/pci_bus_id": "somewhere"}, "nvmlDeviceGetPciInfo", (), {"pci_bus_id"}),
    ({"performance_state": "P99999999999"}, "nvmlDeviceGetPerformanceState", (), {"performance_state"}),
    ({"ecc_errors/volatile/dram_correctable": "-2"}, "nvmlDeviceGetTotalEccErrors", (CORR, VOL),
     {"ecc_volatile_corrected"}),
    ({"ecc_errors/aggregate/sram_uncorrectable": str(U64), "ecc_errors/aggregate/dram_uncorrectable": "1"},
     "nvmlDeviceGetTotalEccErrors", (UNC, AGG), {"ecc_aggregate_uncorrected"}),  # the sum overflows
    ({"retired_pages/multiple_single_bit_retirement/retired_count": "-1"}, "nvmlDeviceGetRetiredPages", (0,),
     {"retired_pages_sbe"}),
])
def test_invalid_capture_cells(tmp_path: Path, cells: dict[str, str], name: str, args: tuple[Any, ...],
                               invalid: set[str]) -> None:
    path = tmp_path / "t4.xml"
    path.write_bytes(edited(T4, cells))
    nvml = opened(path)
    assert nvml.capture.gpus[0].invalid == invalid
    with pytest.raises(pynvml.NVMLError_NotSupported):
        call(nvml, 0, name, *args)
    assert call(nvml, 0, "nvmlDeviceGetName") == "Tesla T4"  # the rest of the capture still answers


def test_invalid_process_and_mig_cells(tmp_path: Path) -> None:
    path = tmp_path / "t4.xml"
    path.write_bytes(edited(T4, {"processes/process_info/pid": "-675"}))
    gpu = open_replay(path).capture.gpus[0]
    assert gpu.invalid == {"processes[0].pid"}
    assert [p.pid for p in gpu.processes] == [5762]  # the process with the invalid pid is left out
    path.write_bytes(edited(T4, {"processes/process_info/used_memory": "-22 MiB"}))
    nvml = opened(path)
    assert nvml.capture.gpus[0].invalid == {"processes[0].used_memory_bytes"}
    assert [(p.pid, p.usedGpuMemory) for p in call(nvml, 0, "nvmlDeviceGetGraphicsRunningProcesses")] == [(675, None)]
    path.write_bytes(edited(A100, {"mig_devices/mig_device/fb_memory_usage/total": "-1 MiB",
                                   "mig_devices/mig_device/gpu_instance_id": str(U32 + 1)}))
    nvml = opened(path)
    assert nvml.capture.gpus[0].invalid == {"migs[0].memory_total_bytes", "migs[0].gpu_instance_id"}
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMemoryInfo(mig)


def test_retired_page_address_beyond_64_bits(tmp_path: Path) -> None:
    tree = ET.parse(T4)
    pages = tree.getroot().find("gpu/retired_pages/double_bit_retirement/retired_pagelist")
    assert pages is not None
    ET.SubElement(pages, "retired_page_address").text = "0x1" + "0" * 16
    path = tmp_path / "t4.xml"
    path.write_bytes(ET.tostring(tree.getroot()))
    nvml = opened(path)
    assert nvml.capture.gpus[0].invalid == {"retired_pages_dbe"}
    with pytest.raises(pynvml.NVMLError_NotSupported):
        call(nvml, 0, "nvmlDeviceGetRetiredPages", 1)


@pytest.mark.parametrize("capture", [H200, A100, A5000, T4])
def test_real_captures_have_no_invalid_cells(capture: Path) -> None:
    assert [g.invalid for g in open_replay(capture).capture.gpus] == [frozenset()] * len(
        open_replay(capture).capture.gpus)


# -- architecture from the PCI device id, when the capture has no <product_architecture> -------------------
@pytest.mark.parametrize(("device_id", "name", "architecture", "capability"), [
    ("1D0110DE", "NVIDIA GeForce GT 1030", pynvml.NVML_DEVICE_ARCH_PASCAL, (6, 1)),      # GP108
    ("1B8210DE", "NVIDIA GeForce GTX 1070 Ti", pynvml.NVML_DEVICE_ARCH_PASCAL, (6, 1)),  # GP104
    ("15F810DE", "Tesla P100-PCIE-16GB", pynvml.NVML_DEVICE_ARCH_PASCAL, (6, 0)),         # GP100
    ("13C210DE", "NVIDIA GeForce GTX 970", pynvml.NVML_DEVICE_ARCH_MAXWELL, (5, 2)),      # GM204
    ("1EB810DE", "Tesla T4", pynvml.NVML_DEVICE_ARCH_TURING, (7, 5)),                     # TU104
])
def test_architecture_guessed_from_the_pci_device_id(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     device_id: str, name: str, architecture: int,
                                                     capability: tuple[int, int]) -> None:
    path = tmp_path / "old-schema.xml"
    text = re.sub(r"\s*<product_architecture>[^<]*</product_architecture>", "", T4.read_text())
    text = re.sub(r"<pci_device_id>[^<]*<", f"<pci_device_id>{device_id}<", text)
    path.write_text(re.sub(r"<product_name>[^<]*<", f"<product_name>{name}<", text))
    with caplog.at_level("WARNING", logger="collectors.replay.capture"):
        nvml = opened(path)
    assert call(nvml, 0, "nvmlDeviceGetArchitecture") == architecture
    assert call(nvml, 0, "nvmlDeviceGetCudaComputeCapability") == capability
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(
        f"{path}: no <product_architecture>; architecture and compute capability guessed from the PCI device id "
        "(NVML index 0: ")


def test_an_unknown_pci_device_id_leaves_the_architecture_absent(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "old-schema.xml"
    text = re.sub(r"\s*<product_architecture>[^<]*</product_architecture>", "", T4.read_text())
    path.write_text(re.sub(r"<pci_device_id>[^<]*<", "<pci_device_id>FFF010DE<", text))
    with caplog.at_level("WARNING", logger="collectors.replay.capture"):
        nvml = opened(path)
    assert call(nvml, 0, "nvmlDeviceGetArchitecture") == 0xFFFFFFFF  # NVML_DEVICE_ARCH_UNKNOWN
    with pytest.raises(pynvml.NVMLError_NotSupported):
        call(nvml, 0, "nvmlDeviceGetCudaComputeCapability")
    assert caplog.records == []


# -- UUIDs: every GPU has one, and its own ------------------------------------------------------------------
def two_gpus(first: str, second: str) -> str:
    return (f'<nvidia_smi_log>\n  <gpu id="00000000:01:00.0">\n    {first}\n  </gpu>\n'
            f'  <gpu id="00000000:02:00.0">\n    {second}\n  </gpu>\n</nvidia_smi_log>\n')


@pytest.mark.parametrize(("xml", "message"), [
    (two_gpus("<uuid>GPU-a</uuid>", "<uuid></uuid>"), r"caps\.xml: line 5: the <gpu> at NVML index 1 has no UUID"),
    (two_gpus("<uuid>N/A</uuid>", "<uuid>GPU-b</uuid>"), r"caps\.xml: line 2: the <gpu> at NVML index 0 has no UUID"),
    (two_gpus("<uuid> </uuid>", "<uuid>GPU-b</uuid>"), r"caps\.xml: line 2: the <gpu> at NVML index 0 has no UUID"),
    (two_gpus("<name>x</name>", "<uuid>GPU-b</uuid>"),
     r"caps\.xml: line 2: the <gpu> at NVML index 0 has no UUID \(<uuid> missing, empty or N/A\); NVML always"),
    (two_gpus("<uuid>Requested functionality has been deprecated</uuid>", "<uuid>GPU-b</uuid>"),
     r"caps\.xml: line 2: the <gpu> at NVML index 0 has no UUID"),
])
def test_capture_uuids(tmp_path: Path, xml: str, message: str) -> None:
    path = tmp_path / "caps.xml"
    path.write_text(xml)
    with pytest.raises(ReplayError, match=message):
        open_replay(path)
    toml = scenario(tmp_path, '[[gpu]]\ncapture = "caps.xml"\n')  # a scenario may not use it either
    with pytest.raises(ReplayError, match=r"scenario\.toml: gpu\[0\]\.capture: bad capture: .*" + message):
        open_replay(toml)


def test_gpus_sharing_a_uuid_replay_as_nvml_shows_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A sanitised capture (dual_2080-v13.xml) gives both GPUs one UUID. NVML never shows two equal
    UUIDs: the later GPU gets a derived one, with one warning; a scenario may give it its own."""
    path = tmp_path / "caps.xml"
    path.write_text(two_gpus("<uuid>GPU-a</uuid>", "<uuid>GPU-a</uuid>"))
    derived = "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_OID, "GPU-a/1"))
    with caplog.at_level("WARNING", logger="collectors.replay.capture"):
        nvml = opened(path)
    assert [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)] == ["GPU-a", derived]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: line 5: the <gpu> at NVML index 1 has uuid 'GPU-a', as has the <gpu> at NVML index 0 (line 2); "
        f"NVML never reports two equal UUIDs; replaying it as {derived!r}"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="collectors.replay.capture"):
        nvml = opened(scenario(tmp_path, """
            [[gpu]]
            capture = "caps.xml"
            [[gpu]]
            capture = "caps.xml"
            capture_index = 1
            uuid = "GPU-b"
        """))
    assert [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)] == ["GPU-a", "GPU-b"]
    assert caplog.records == []


def test_capture_with_distinct_uuids_loads(tmp_path: Path) -> None:
    path = tmp_path / "caps.xml"
    path.write_text(two_gpus("<uuid>GPU-a</uuid>", "<uuid>GPU-b</uuid>"))
    nvml = opened(path)
    assert [call(nvml, i, "nvmlDeviceGetUUID") for i in (0, 1)] == ["GPU-a", "GPU-b"]


# -- whatever the bytes, from_path raises ReplayError or loads; what loads answers or raises NVMLError ------
def answer_everything(nvml: ReplayedNVML) -> None:
    """Every implemented device call on every GPU: a value (ints within NVML's types) or an NVMLError."""
    nvml.nvmlInit()
    for index in range(nvml.nvmlDeviceGetCount()):
        for name in sorted(IMPLEMENTED_CALLS - SYSTEM_CALLS.keys()):
            try:
                value = call(nvml, index, name, *with_sets(nvml, DEVICE_CALL_ARGS.get(name, ())))
            except pynvml.NVMLError:
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                assert not isinstance(v, int) or 0 <= v <= U64, (name, value)
    es = nvml.nvmlEventSetCreate()
    for index in range(nvml.nvmlDeviceGetCount()):
        with contextlib.suppress(pynvml.NVMLError):
            call(nvml, index, "nvmlDeviceRegisterEvents", XID, es)
    for _ in events_of(nvml):
        try:
            data = nvml.nvmlEventSetWait_v2(es, 0)
        except pynvml.NVMLError:
            break
        assert 0 < data.eventData <= U64 and 0 <= data.gpuInstanceId <= U32


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2000), suffix=st.sampled_from([".toml", ".xml"]))
def test_arbitrary_bytes_raise_only_replay_error(tmp_path: Path, data: bytes, suffix: str) -> None:
    path = tmp_path / f"fuzz{suffix}"
    path.write_bytes(data)
    try:
        nvml = open_replay(path)
    except ReplayError:
        return
    answer_everything(nvml)


CELLS = ["temperature/gpu_temp", "clocks/sm_clock", "fb_memory_usage/total", "fb_memory_usage/free",
         "power_readings/power_draw", "fan_speed", "minor_number", "uuid", "pci/pci_bus_id", "performance_state",
         "ecc_errors/volatile/dram_correctable", "processes/process_info/pid", "processes/process_info/used_memory"]
cell_text = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70).map(str),
    st.tuples(st.integers(min_value=-(1 << 70), max_value=1 << 70),
              st.sampled_from([" C", " MHz", " MiB", " GiB", " W", " %", ""])).map(lambda t: f"{t[0]}{t[1]}"),
    st.sampled_from(["N/A", "", "Unknown", "Requested functionality has been deprecated", "P0", "0x10"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=20))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cells=st.dictionaries(st.sampled_from(CELLS), cell_text, max_size=6))
def test_arbitrary_cells_raise_only_replay_error(tmp_path: Path, cells: dict[str, str]) -> None:
    path = tmp_path / "t4.xml"
    path.write_bytes(edited(T4, cells))
    try:
        nvml = open_replay(path)
    except ReplayError:
        assert "uuid" in cells
        return
    answer_everything(nvml)


toml_value = st.one_of(st.integers(min_value=-(1 << 70), max_value=1 << 70).map(str),
                       st.floats().map(repr),  # TOML spells inf, -inf and nan as Python does
                       st.sampled_from(['"N/A"', '""', '"x"', "true", "[]", "{}"]))
KEYS = [("[gpu.override]", k) for k in ("temp_gpu_c", "memory_total_bytes", "memory_free_bytes", "minor", "uuid",
                                        "clock_reasons", "pci_bus_id", "power_usage_mw")] + \
       [("[[gpu.process]]\npid = 7", k)
        for k in ("used_memory_bytes", "sm_utilization_percent", "start_s", "end_s")] + \
       [("[[gpu.process]]\npid = 7\n[[gpu.process.step]]", k) for k in ("at_s", "sm_utilization_percent")] + \
       [('[[fault]]\ncall = "*"\ngpu = 0\nerror = "UNKNOWN"', k) for k in ("hang_seconds", "after_calls", "times")] + \
       [("[[gpu.xid]]\nxid = 79", k) for k in ("at_s", "gpu_instance_id")] + \
       [("[[gpu.xid]]", "xid"), ("", "lost_at_s"), ("[gpu.errors]", "nvmlDeviceGetTemperature"),
        ("[gpu.hangs]", "nvmlDeviceGetTemperature"), ("[gpu.hangs]", '"*"')]


def sleep_checked(seconds: float) -> None:
    """Instead of time.sleep, which raises OverflowError (inf, 1e300) or ValueError (nan, < 0)."""
    assert math.isfinite(seconds) and 0 <= seconds < 9.2e9, seconds


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=toml_value)
def test_arbitrary_scenario_values_raise_only_replay_error(tmp_path: Path, key: tuple[str, str], value: str) -> None:
    table, name = key
    path = scenario(tmp_path, f'[[gpu]]\ncapture = "@H200"\n{table}\n{name} = {value}\n')
    try:
        nvml = open_replay(path, sleep=sleep_checked)
    except ReplayError:
        return
    answer_everything(nvml)


def test_scenario_migs_replace_the_captures_invalid_mig_cells(tmp_path: Path) -> None:
    (tmp_path / "a100.xml").write_bytes(edited(A100, {"mig_devices/mig_device/fb_memory_usage/total": "-1 MiB",
                                                      "temperature/gpu_temp": "-1 C"}))
    (tmp_path / "t4.xml").write_bytes(edited(T4, {"processes/process_info/pid": "-1"}))
    nvml = opened(scenario(tmp_path, '[[gpu]]\ncapture = "a100.xml"\n[[gpu.mig]]\ngpu_instance_id = 1\n'
                                     'profile = "1g.10gb"\nmemory_total_bytes = 1024\n'
                                     '[[gpu]]\ncapture = "t4.xml"\n[[gpu.process]]\npid = 9\n'))
    assert nvml.capture.gpus[0].invalid == frozenset({"temp_gpu_c"})
    assert nvml.capture.gpus[1].invalid == frozenset({"processes[0].pid"})  # processes are added, not replaced
    assert type(nvml.capture.gpus[0].deprecated) is frozenset
