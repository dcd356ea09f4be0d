"""Driver generations: the replayed libnvidia-ml exports what that driver's library exports, the real
pynvml runs on top, and accelstats keeps every GPU up with the families that driver can give.

The symbol lists are NVIDIA's (``collectors/replay/symbols.json``, from the ``nvml.h`` published with
each driver in github.com/NVIDIA/nvidia-settings); the expectations below are read off those headers.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.paths import find_shared

from collectors.nvidia import NvidiaBackend
from collectors.replay.lib import generation_for, generations, open_replay
from collectors.replay.state import ReplayError

FIXTURES = find_shared() / "fixtures"
T4 = FIXTURES / "public" / "tesla-t4.xml"
A100 = FIXTURES / "public" / "a100-sxm4-v12.xml"
H200 = FIXTURES / "h200" / "nvidia-smi-q.xml"
NA = 0xFFFFFFFF

# (driver version, the version of the header whose symbols it gets)
PICKS = [
    ("470.256.02", "470.256.02"), ("470.57.02", "470.256.02"), ("510.47.03", "510.108.03"),
    ("515.105.01", "515.105.01"), ("525.60.13", "525.147.05"), ("535.54.03", "535.309.01"),
    ("550.54.15", "550.144.03"), ("555.42.02", "550.144.03"), ("570.86.15", "570.211.01"),
    ("580.159.04", "580.173.02"), ("590.44.01", "590.48.01"), ("999.1", "590.48.01"), (None, "590.48.01"),
]


@pytest.mark.parametrize(("driver", "header"), PICKS)
def test_a_driver_gets_the_newest_header_not_newer_than_it(driver: str | None, header: str) -> None:
    assert generation_for(driver).version == header


def test_drivers_before_r470_get_the_oldest_generation() -> None:
    assert generation_for("418.43").version == generation_for("460.91.03").version == "470.256.02"


def test_a_pre_r470_capture_replays_as_r470_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """telegraf's gtx-1660-ti.xml and quadro-p400.xml name driver 418.43: a real host answers them, so
    the replay does too, as the oldest generation it knows, and says once which it guessed."""
    capture = tmp_path / "driver-418.xml"
    capture.write_text(re.sub(r"<driver_version>[^<]*<", "<driver_version>418.43<", T4.read_text()))
    with caplog.at_level("WARNING", logger="collectors.replay.lib"):
        nvml = open_replay(capture)
    assert nvml.generation.version == "470.256.02"
    assert [r.getMessage() for r in caplog.records] == [
        f"{capture}: <driver_version>: driver 418.43 is older than the oldest NVML generation replayed; "
        "replaying it as R470 (470.256.02), whose functions a driver this old may lack"]
    got = dump(capture)
    assert [v for _, v in got["accelstats_gpu_up"]] == [1.0]
    assert {labels["driver_version"] for labels, _ in got["accelstats_gpu_info"]} == {"418.43"}


# (header, symbol, exported?) read off NVIDIA's nvml.h of each driver
@pytest.mark.parametrize(("header", "symbol", "exported"), [
    ("470.256.02", "nvmlDeviceGetComputeRunningProcesses_v2", True),
    ("470.256.02", "nvmlDeviceGetComputeRunningProcesses_v3", False),
    ("470.256.02", "nvmlDeviceGetMemoryInfo_v2", False),
    ("470.256.02", "nvmlDeviceGetCurrentClocksThrottleReasons", True),
    ("470.256.02", "nvmlDeviceGetCurrentClocksEventReasons", False),
    ("470.256.02", "nvmlEventSetWait_v2", True),
    ("510.108.03", "nvmlDeviceGetComputeRunningProcesses_v3", True),  # _v3 and memory v2 arrive in R510
    ("510.108.03", "nvmlDeviceGetMemoryInfo_v2", True),
    ("515.105.01", "nvmlDeviceGetComputeRunningProcesses_v3", True),
    ("515.105.01", "nvmlDeviceGetMemoryInfo_v2", True),
    ("515.105.01", "nvmlDeviceGetCurrentClocksEventReasons", False),
    ("535.309.01", "nvmlDeviceGetCurrentClocksEventReasons", True),
    ("580.173.02", "nvmlDeviceGetComputeRunningProcesses_v3", True),
    ("580.173.02", "nvmlDeviceGetComputeRunningProcesses", True),  # old names stay exported
])
def test_symbol_lists_follow_nvidias_headers(header: str, symbol: str, exported: bool) -> None:
    (generation,) = [g for g in generations() if g.version == header]
    assert (symbol in generation.symbols) is exported
    assert generation.source.startswith("github.com/NVIDIA/nvidia-settings tag ") and len(generation.sha256) == 64


def scenario(tmp_path: Path, driver: str, capture: Path = T4, extra: str = "") -> Path:
    path = tmp_path / f"r{driver.split('.')[0]}.toml"
    path.write_text(f'driver_version = "{driver}"\n{extra}[[gpu]]\ncapture = "{capture.as_posix()}"\n'
                    "[[gpu.process]]\npid = 4242\nused_memory_bytes = 1073741824\nsm_utilization_percent = 35\n")
    return path


def test_pynvml_itself_fails_on_r470_as_on_a_real_host(tmp_path: Path) -> None:
    """The defect accelstats must survive: pynvml's nvmlDeviceGetComputeRunningProcesses calls the
    _v3 symbol, which a R470 library lacks, and raises NVMLLibraryMismatchError (not an NVMLError)."""
    nvml = open_replay(scenario(tmp_path, "470.256.02"))
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert not isinstance(pynvml.NVMLLibraryMismatchError("x"), pynvml.NVMLError)
    assert 4242 in [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses_v2(handle)]
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    nvml.nvmlShutdown()


def dump(path: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    proc = subprocess.run([sys.executable, "-m", "accelstats", "dump", "--nvml-replay", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(proc.stdout):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_a_replay_is_labelled_in_gpu_info_only() -> None:
    """README: `accelstats_gpu_info` says `source="replay"`; no other series has a `source` label."""
    got = dump(H200)
    assert [labels["source"] for labels, _ in got["accelstats_gpu_info"]] == ["replay"]
    assert sorted({name for name, samples in got.items() for labels, _ in samples if "source" in labels}) == [
        "accelstats_gpu_info"]


# (driver, NVML calls accelstats finds missing and counts once; every family below is still given)
GENERATIONS = [
    ("470.256.02", {"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses",
                    "nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses",
                    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlGpmQueryDeviceSupport"}),
    ("510.108.03", {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlGpmQueryDeviceSupport"}),  # GPM: R525 on
    ("515.105.01", {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlGpmQueryDeviceSupport"}),
    ("525.147.05", {"nvmlDeviceGetCurrentClocksEventReasons"}),
    ("535.309.01", set()),
    ("550.144.03", set()),
    ("580.173.02", set()),
    ("590.48.01", set()),
]
FAMILIES = ["accelstats_gpu_memory_used_bytes", "accelstats_gpu_utilization_ratio", "accelstats_gpu_power_watts",
            "accelstats_gpu_clock_event_active", "accelstats_gpu_processes", "accelstats_gpu_temperature_celsius"]


@pytest.mark.parametrize(("driver", "missing"), GENERATIONS)
def test_accelstats_dump_on_each_driver_generation(tmp_path: Path, driver: str, missing: set[str]) -> None:
    got = dump(scenario(tmp_path, driver))
    assert [v for _, v in got["accelstats_gpu_up"]] == [1.0]
    assert {labels["driver_version"] for labels, _ in got["accelstats_gpu_info"]} == {driver}
    for family in FAMILIES:
        assert family in got, family
    assert {labels["type"]: v for labels, v in got["accelstats_gpu_processes"]}["compute"] >= 1
    errors = {(labels["call"], labels["error"]): v for labels, v in got.get("accelstats_nvml_errors_total", [])}
    assert errors == {(call, "FUNCTION_NOT_FOUND"): 1.0 for call in missing}


def test_a_library_older_than_pynvml_in_other_ways(tmp_path: Path) -> None:
    """A library without memory info v2, per-process utilisation or event calls: GPUs stay up, memory
    comes from v1, the rest is absent with the reason counted once."""
    path = scenario(tmp_path, "580.173.02", H200, 'missing_functions = ["nvmlDeviceGetMemoryInfo_v2", '
                    '"nvmlDeviceGetProcessUtilization", "nvmlEventSetCreate", "nvmlEventSetWait_v2"]\n')
    nvml = open_replay(path)
    backend = NvidiaBackend(nvml, pcie_interval=0)
    try:
        assert backend.setup()
        assert backend.xid_watcher is not None and backend.xid_watcher.watching == []
        for _ in range(2):
            readings = [backend.sample(s) for s in backend._devices]
        assert [r.up for r in readings] == [True]
        (r,) = readings
        assert r.memory_total_bytes == 143771 << 20 and r.memory_reserved_bytes is None  # v1: no reserved
        assert r.processes is not None and [(p.pid, p.sm_utilization_ratio) for p in r.processes] == [(4242, None)]
        assert backend.call.errors == {("nvmlDeviceGetMemoryInfo", "FUNCTION_NOT_FOUND"): 1,
                                       ("nvmlDeviceGetProcessUtilization", "FUNCTION_NOT_FOUND"): 1,
                                       ("nvmlEventSetCreate", "FUNCTION_NOT_FOUND"): 1}
    finally:
        backend.close()


def test_one_failed_memory_v2_call_does_not_switch_to_v1(tmp_path: Path) -> None:
    """v1 counts reserved memory as used: only a library without v2 may switch to it."""
    path = scenario(tmp_path, "580.173.02", H200, "")
    path.write_text(path.read_text() + '[[fault]]\ncall = "nvmlDeviceGetMemoryInfo"\nerror = "NO_PERMISSION"\n'
                    "times = 1\n")
    backend = NvidiaBackend(open_replay(path), pcie_interval=0)
    try:
        assert backend.setup()
        (state,) = backend._devices
        first, second = backend.sample(state), backend.sample(state)
        assert first.memory_used_bytes is None  # the failed v2 read: no figure, not v1's
        assert second.memory_used_bytes == 0 and second.memory_reserved_bytes == 616 << 20  # v2 again
    finally:
        backend.close()


def test_pynvml_is_not_patched(tmp_path: Path) -> None:
    """The only thing the replay sets in pynvml is its library: every pynvml function is pynvml's own."""
    from collectors.replay.lib import LIBRARY

    nvml = open_replay(H200)
    nvml.nvmlInit()
    nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0))
    assert pynvml.nvmlLib is LIBRARY
    functions = [v for v in vars(pynvml).values() if inspect.isfunction(v)]  # _nvmlGetFunctionPointer too
    own = [f for f in functions if f.__module__ == "pynvml"]
    assert len(own) > 300 and {f.__code__.co_filename for f in own} == {pynvml.__file__}
    assert {f.__module__ for f in functions} <= {"pynvml", "ctypes", "ctypes.util", "functools"}  # its imports
    nvml.nvmlShutdown()


# -- the C functions themselves, called as a C caller would ------------------------------------------
def c_function(name: str) -> Any:
    return getattr(pynvml.nvmlLib, name)


@pytest.fixture
def handle() -> Any:
    nvml = open_replay(A100)
    nvml.nvmlInit()
    yield nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()


def test_a_short_string_buffer_is_insufficient_size_and_left_untouched(handle: Any) -> None:
    buf = ctypes.create_string_buffer(b"x" * 8, 8)
    assert c_function("nvmlDeviceGetName")(handle, buf, ctypes.c_uint(8)) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert buf.raw == b"x" * 8
    big = ctypes.create_string_buffer(96)
    assert c_function("nvmlDeviceGetName")(handle, big, ctypes.c_uint(96)) == pynvml.NVML_SUCCESS
    assert big.value == b"NVIDIA A100-SXM4-80GB"


@pytest.mark.parametrize("name", ["nvmlDeviceGetMinorNumber", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2",
                                  "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetName"])
def test_null_out_pointers_are_invalid_argument(handle: Any, name: str) -> None:
    args = {"nvmlDeviceGetComputeRunningProcesses_v3": (None, None), "nvmlDeviceGetName": (None, ctypes.c_uint(64))}
    assert c_function(name)(handle, *args.get(name, (None,))) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_process_lists_follow_the_two_call_protocol(tmp_path: Path) -> None:
    path = tmp_path / "procs.toml"
    path.write_text(f'[[gpu]]\ncapture = "{H200.as_posix()}"\n' + "".join(
        f"[[gpu.process]]\npid = {pid}\nused_memory_bytes = {pid}\n" for pid in (11, 12, 13)))
    nvml = open_replay(path)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    fn, count = c_function("nvmlDeviceGetComputeRunningProcesses_v3"), ctypes.c_uint(0)
    assert fn(h, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE and count.value == 3
    infos = (pynvml.c_nvmlProcessInfo_v2_t * 4)()
    count.value = 2  # too small
    assert fn(h, ctypes.byref(count), infos) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE and count.value == 3
    assert infos[0].pid == 0  # nothing written
    count.value = 4
    assert fn(h, ctypes.byref(count), infos) == pynvml.NVML_SUCCESS and count.value == 3
    assert [(i.pid, i.usedGpuMemory, i.gpuInstanceId) for i in infos[:3]] == [(11, 11, NA), (12, 12, NA), (13, 13, NA)]
    assert infos[3].pid == 0
    class ProcessInfoV1(ctypes.Structure):  # nvml.h's nvmlProcessInfo_v1_t (pynvml has none): 16 bytes
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    v1 = (ProcessInfoV1 * 3)()  # the unversioned symbol writes the v1 layout
    count.value = 3
    assert c_function("nvmlDeviceGetComputeRunningProcesses")(h, ctypes.byref(count), v1) == pynvml.NVML_SUCCESS
    assert [(i.pid, i.usedGpuMemory) for i in v1] == [(11, 11), (12, 12), (13, 13)]
    nvml.nvmlShutdown()


def test_memory_v2_checks_the_structure_version(handle: Any) -> None:
    mem = pynvml.c_nvmlMemory_v2_t()
    mem.version = 2  # not NVML_STRUCT_VERSION(Memory, 2)
    assert c_function("nvmlDeviceGetMemoryInfo_v2")(handle, ctypes.byref(mem)) == \
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    mem.version = 0x02000028  # sizeof(nvmlMemory_v2_t) = 40, version 2 (nvml.h)
    assert c_function("nvmlDeviceGetMemoryInfo_v2")(handle, ctypes.byref(mem)) == pynvml.NVML_SUCCESS
    assert mem.total == 81920 << 20


def test_handle_address_identifies_a_device() -> None:
    from collectors.xid import handle_address

    nvml = open_replay(A100)
    nvml.nvmlInit()
    a, b = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(0)
    assert a is not b and handle_address(a) == handle_address(b) != 0
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(a, 0)
    assert handle_address(mig) not in (None, handle_address(a))
    assert handle_address(object()) is None
    nvml.nvmlShutdown()


@pytest.mark.parametrize(("text", "message"), [
    ('driver_version = "abc"\n', r"driver_version: expected a driver version"),
    ('missing_functions = ["nvmlFoo"]\n', r"missing_functions: nvmlFoo: not a function of any libnvidia-ml"),
    ('missing_functions = "nvmlInit"\n', r"missing_functions: expected list"),
])
def test_bad_driver_keys_name_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text + f'[[gpu]]\ncapture = "{H200.as_posix()}"\n')
    with pytest.raises(ReplayError, match=message) as exc:
        open_replay(path)
    assert str(path) in str(exc.value)


def test_without_the_test_rig_fault_tables_are_refused_and_no_file_is_executed(tmp_path: Path) -> None:
    """As in production: a process started without tests/support/site on PYTHONPATH registers no
    extension. A capture and a plain scenario replay; a scenario with [[fault]] is refused with the
    reason; and a Python file named by the environment variable that used to load the extension is not
    executed (it would leave a mark)."""
    plain = tmp_path / "plain.toml"
    plain.write_text(f'[[gpu]]\ncapture = "{H200.as_posix()}"\n')
    faulty = tmp_path / "faulty.toml"
    faulty.write_text(plain.read_text() + '[[fault]]\ncall = "nvmlInit"\nerror = "UNKNOWN"\n')
    mark = tmp_path / "executed"
    planted = tmp_path / "planted.py"
    planted.write_text(f"open({str(mark)!r}, 'w').close()\nTABLES = ('fault', 'event')\ndef attach(state): pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["ACCELSTATS_REPLAY_EXTENSION"] = str(planted)
    for path, rc in ((H200, 0), (plain, 0), (faulty, 2)):
        proc = subprocess.run([sys.executable, "-m", "accelstats", "devices", "--json", "--nvml-replay", str(path)],
                              capture_output=True, text=True, timeout=60, check=False, env=env)
        assert proc.returncode == rc, proc.stderr
    assert proc.stderr == (f"accelstats: error: {faulty}: [[fault]]: call-counting fault injection is test support "
                           "(tests/support/replay_faults.py), not part of accelstats; a GPU's own failures are its "
                           "[[gpu]] keys lost_at_s, [gpu.errors], [gpu.hangs] and [[gpu.xid]] (docs/replay.md)\n")
    assert not mark.exists()


def test_in_process_the_extension_is_what_was_registered(tmp_path: Path) -> None:
    """The tests' own process has the rig registered (tests/conftest.py); without it the same scenario is
    refused, and with it again the fault is attached."""
    from support import replay_faults

    from collectors.replay.lib import ReplayExtension, register_extension

    faulty = tmp_path / "faulty.toml"
    faulty.write_text(f'[[gpu]]\ncapture = "{H200.as_posix()}"\n[[fault]]\ncall = "nvmlInit"\nerror = "UNKNOWN"\n')
    previous = register_extension(None)
    try:
        assert previous == ReplayExtension("tests/support/replay_faults.py", ("fault",), replay_faults.attach)
        with pytest.raises(ReplayError, match=r"\[\[fault\]\]: call-counting fault injection is test support"):
            open_replay(faulty)
    finally:
        register_extension(previous)
    nvml = open_replay(faulty)
    assert replay_faults.faults_of(nvml.state) == (replay_faults.Fault(call="nvmlInit", error="UNKNOWN"),)
