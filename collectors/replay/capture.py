"""The inputs of the NVML replay as plain values: ``nvidia-smi -q -x`` captures and scenario TOML.

Pure functions over the standard library (``xml.etree.ElementTree``, ``tomllib``; expat never
fetches the ``<!DOCTYPE … SYSTEM "nvsmi_device_vNN.dtd">`` the captures name). Every value is
converted to the unit NVML answers in: bytes (``"143771 MiB"`` → 143771 x 2^20), milliwatts
(``"79.43 W"`` → 79430), MHz, percent, degrees C, KB/s, plain integers (``"16x"`` → 16).

``None`` means the capture has no usable value: the cell is ``N/A``, ``[N/A]``, ``Not Supported``,
``Unknown``, empty, or the element is missing in this schema version; the replay answers such a
call with NVML_ERROR_NOT_SUPPORTED. A cell reading ``Requested functionality has been deprecated``
(nvidia-smi prints ``nvmlErrorString(NVML_ERROR_DEPRECATED)``) is also ``None`` and its field name
is listed in :attr:`GpuCapture.deprecated`, so the replay raises NVML_ERROR_DEPRECATED instead.

A cell NVML could not have answered is invalid: text that does not convert (``"warm"`` for a
temperature, a malformed PCI bus id) or a number outside the range of the C type NVML answers it
in (every NVML reading is unsigned: ``-36 C``, ``-1980 MHz``, ``-5 MiB``, or more than 2^32-1 /
2^64-1, :func:`int_max`). Such a value is also ``None`` (the call raises NOT_SUPPORTED, as for N/A)
and its field name is listed in :attr:`GpuCapture.invalid` (``temp_gpu_c``, ``processes[1].pid``,
``migs[0].memory_total_bytes``; a process whose pid is invalid is left out), so that nothing wraps
around or comes out negative. The capture as a whole is rejected (CaptureError naming the
``<gpu>``'s NVML index and line) only when a GPU has no UUID (``<uuid>`` missing, empty or N/A:
NVML always reports one). A GPU with the UUID of an earlier ``<gpu>`` (a sanitised capture) gets a
distinct one (:func:`distinct_uuid`) and a warning, unless a scenario gives it its own.

Schema versions differ (``<!DOCTYPE>`` v11: Tesla T4, v12: A100, v13: H200 / RTX A5000):
``clocks_throttle_reasons`` (≤ v11) vs ``clocks_event_reasons``; ``power_readings`` with
``power_draw`` / ``power_limit`` / ``enforced_power_limit`` (≤ v11) vs ``gpu_power_readings`` with
``power_draw`` (v12) or ``average_power_draw`` + ``instant_power_draw`` (v13) and
``requested_power_limit`` / ``current_power_limit``; ``sram_uncorrectable`` (≤ v12) vs
``sram_uncorrectable_parity`` + ``sram_uncorrectable_secded`` (v13). Each field below lists the
element paths it is read from, first match wins.

A scenario TOML picks GPUs out of captures, overrides their identity and readings, adds processes
and MIG instances, and names the driver (:func:`load_scenario`)::

    [[gpu]]                          # NVML index = position, unless `index` is given
    capture = "nvidia-smi-q.xml"     # relative to the TOML file; required
    capture_index = 0                # which <gpu> of the capture (default 0)
    index = 0                        # optional overrides: NVML index, minor, uuid, name, pci_bus_id
    process_samples = "mean"         # optional: how nvmlDeviceGetProcessUtilization answers: "mean" (one
                                     #   sample per process, the mean since lastSeenTimeStamp) or "every"
                                     #   (every busy driver sample); collectors.replay.state
    [gpu.override]                   # optional: any GpuCapture field, e.g. temp_gpu_c = 80;
    power_usage_mw = 300000          #   the string "N/A" makes that call raise NOT_SUPPORTED
    [[gpu.process]]                  # added to the capture's <processes> (same pid and type: replaced)
    pid = 4242                       # required
    used_memory_bytes = 1073741824   # optional (absent: usedGpuMemory None)
    sm_utilization_percent = 35      # optional: feeds nvmlDeviceGetProcessUtilization
    start_s = 10                     # optional: listed from 10 s after the first nvmlInit (default 0)
    end_s = 70                       # optional: and until 70 s (default: for ever)
    [[gpu.process.step]]             # optional, in time order: from at_s on, these values
    at_s = 30                        #   (seconds after the first nvmlInit)
    sm_utilization_percent = 80      #   either key may be left out: unchanged
    used_memory_bytes = 2147483648
    type = "compute"                 # "compute" (default) | "graphics" | "mps"
    name = "python"                  # optional
    [[gpu.mig]]                      # replaces the capture's MIG devices and enables MIG mode
    gpu_instance_id = 1              # required
    profile = "1g.18gb"              # required
    memory_total_bytes = 17716740096 # required
    compute_instance_id = 0          # optional; uuid optional (default: collectors.replay.state.mig_uuid)
    [[gpu.mig.process]]              # same keys as [[gpu.process]], runs in this instance
    driver_version = "470.256.02"    # top level, optional: the driver the replayed library is, which
                                     #   selects the NVML symbols it exports (collectors.replay.lib);
                                     #   default: the first capture's <driver_version>
    missing_functions = ["nvmlDeviceGetProcessUtilization"]  # optional: NVML functions the library
                                     #   does not export, on top of what that driver lacks

A ``[[gpu]]`` also describes the device's state over time (seconds after the first ``nvmlInit``;
applied by :mod:`collectors.replay.device_state`)::

    lost_at_s = 20                   # falls off the bus: every call naming it answers GPU_IS_LOST from then on
    [gpu.errors]                     # these calls on this GPU answer NVML_ERROR_<name> ("*": every call)
    nvmlDeviceGetEncoderUtilization = "NO_PERMISSION"
    [gpu.hangs]                      # these calls on this GPU block this many seconds first ("*": every call)
    nvmlDeviceGetTemperature = 5
    [[gpu.xid]]                      # an XID event (nvmlEventSetWait_v2)
    xid = 79                         # required, 1..2^64-1
    at_s = 0.5                       # due this long after the first nvmlInit (default 0)
    gpu_instance_id = 1              # optional, MIG: one of this GPU's instances (compute_instance_id too)

GPM profiling metrics and NVLink links (a Hopper-or-newer GPU; :mod:`collectors.replay.gpm` answers them)::

    [gpu.gpm]                        # the GPU supports GPM; nvmlGpmMetricsGet answers these values
    sm_util = 80.0                   #   between any two samples: NVML_GPM_METRIC_<KEY> in lower case, in
    any_tensor_util = 55.0           #   NVML's units (percent 0-100, MiB/s for the *_per_sec ones); a
    dram_bw_util = 30.0              #   metric left out answers NOT_SUPPORTED; no table: not a GPM device
    [gpu.mig.gpm]                    # the same for one MIG instance (nvmlGpmMigSampleGet)
    [[gpu.nvlink]]                   # one NVLink link (nvmlDeviceGetNvLinkState, field values, error counters)
    link = 0                         # required, 0..NVML_NVLINK_MAX_LINKS-1, each once
    state = "up"                     # "up" (default) | "down"
    throughput_data_tx = 1024        # KiB sent so far (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX; default 0)
    throughput_data_rx = 2048        # KiB received so far (…_DATA_RX; default 0)
    crc_flit_errors = 0              # nvmlDeviceGetNvLinkErrorCounter NVML_NVLINK_ERROR_DL_CRC_FLIT (default 0)
    replay_errors = 0                # … NVML_NVLINK_ERROR_DL_REPLAY (default 0)
    recovery_errors = 0              # … NVML_NVLINK_ERROR_DL_RECOVERY (default 0)

The top-level ``[[fault]]`` table (call-counting failures and hangs) is test support, read by
``tests/support/replay_faults.py`` through ``ReplayState.extra``; the product refuses it unless asked
to keep it (``tables``).

Scenario integers must fit the C type NVML answers them in (unsigned int; unsigned long long for
bytes, ECC counts and ``clock_reasons``; ``used_memory_bytes`` below 2^64-1, which is
NVML_VALUE_NOT_AVAILABLE); ``uuid`` must not be empty (or ``"N/A"``); ``driver_version`` must
start with a major version number.

Errors in either input are :class:`CaptureError`, naming the file and the line/column (malformed
XML or TOML; the line and byte offset of a scenario that is not UTF-8) or the key.

Facts the XML does not hold are derived here, each from a documented table: CUDA compute
capability and NVML architecture code (from ``product_architecture``, the PCI device id's chip
(:mod:`collectors.replay.pci_chips`) and the product name), and a MIG instance's profile name (from
its SM count and memory share). A capture without ``<product_architecture>`` (older schemas) gets
the architecture of its PCI device id's chip, with one warning per file; an id no range lists
leaves it absent.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import stat
import sys
import uuid as uuidlib
import xml.etree.ElementTree as ET
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields, replace
from decimal import Decimal
from pathlib import Path
from typing import Any, NoReturn
from xml.parsers import expat

from collectors.replay.pci_chips import chip_for

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

_ABSENT = frozenset({"", "n/a", "[n/a]", "not supported", "[not supported]", "unknown", "[unknown error]"})
_DEPRECATED = "requested functionality has been deprecated"
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

# nvmlClocksEventReason* bits (nvml.h; equal to pynvml's nvmlClocksEventReason*/ThrottleReason*),
# keyed by the element name after the ``clocks_event_reason_`` / ``clocks_throttle_reason_`` prefix.
CLOCK_REASON_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clocks_setting": 0x100,
}

# nvmlReturn_t names (nvml.h NVML_ERROR_*, without the prefix) a scenario's ``[gpu.errors]`` may give.
NVML_ERRORS = frozenset({
    "UNINITIALIZED", "INVALID_ARGUMENT", "NOT_SUPPORTED", "NO_PERMISSION", "ALREADY_INITIALIZED", "NOT_FOUND",
    "INSUFFICIENT_SIZE", "INSUFFICIENT_POWER", "DRIVER_NOT_LOADED", "TIMEOUT", "IRQ_ISSUE", "LIBRARY_NOT_FOUND",
    "FUNCTION_NOT_FOUND", "CORRUPTED_INFOROM", "GPU_IS_LOST", "RESET_REQUIRED", "OPERATING_SYSTEM",
    "LIB_RM_VERSION_MISMATCH", "IN_USE", "MEMORY", "NO_DATA", "VGPU_ECC_NOT_SUPPORTED", "INSUFFICIENT_RESOURCES",
    "FREQ_NOT_SUPPORTED", "ARGUMENT_VERSION_MISMATCH", "DEPRECATED", "NOT_READY", "GPU_NOT_FOUND",
    "INVALID_STATE", "RESET_TYPE_NOT_SUPPORTED", "UNKNOWN"})

# NVML_DEVICE_ARCH_* (nvml.h) by lower-cased ``product_architecture``.
ARCHITECTURES = {
    "kepler": 2, "maxwell": 3, "pascal": 4, "volta": 5, "turing": 6, "ampere": 7,
    "ada lovelace": 8, "ada": 8, "hopper": 9, "blackwell": 10,
}
ARCH_UNKNOWN = 0xFFFFFFFF

# CUDA compute capability (NVIDIA's CUDA GPUs table): (architecture, product-name regex, (major, minor)),
# first match wins. Hopper 9.0; Ampere GA100 (A100, A800, A30) 8.0, other Ampere (RTX A5000, A10, A40,
# GeForce 30) 8.6; Turing (T4) 7.5; Volta 7.0; Ada 8.9; Blackwell data-centre 10.0, RTX 12.0;
# Pascal P100 6.0, other Pascal 6.1.
COMPUTE_CAPABILITY: tuple[tuple[str, str, tuple[int, int]], ...] = (
    ("hopper", "", (9, 0)),
    ("ampere", r"\bA(100|800|30)\b", (8, 0)),
    ("ampere", "", (8, 6)),
    ("ada lovelace", "", (8, 9)),
    ("ada", "", (8, 9)),
    ("turing", "", (7, 5)),
    ("volta", "", (7, 0)),
    ("blackwell", r"\bRTX\b", (12, 0)),
    ("blackwell", "", (10, 0)),
    ("pascal", r"\bP100\b", (6, 0)),
    ("pascal", "", (6, 1)),
)

# SMs in one MIG compute slice ("1g"): A100/A30 14, H100/H200 16 (NVIDIA MIG user guide profiles).
MIG_SMS_PER_SLICE = {"ampere": 14, "hopper": 16}


class CaptureError(ValueError):
    """The file is not an ``nvidia-smi -q -x`` capture; the message names the file and position."""


@dataclass(frozen=True)
class ProcessCapture:
    """One ``<process_info>`` (or scenario process). ``types`` ⊆ {"compute", "graphics", "mps"}:
    nvidia-smi type ``C`` → compute, ``G`` → graphics, ``C+G`` → both, ``M+C`` / ``M`` → mps.
    ``used_memory_bytes`` None when N/A; instance ids None outside MIG."""

    pid: int
    types: frozenset[str]
    used_memory_bytes: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    sm_utilization_percent: int | None = None
    name: str = ""
    start_s: float = 0.0
    end_s: float | None = None
    steps: tuple[tuple[float, int | None, int | None], ...] = ()
    """Scenario timeline (seconds after the first ``nvmlInit``): the process is listed from ``start_s``
    until ``end_s`` (None: for ever); from each step's ``at_s`` on, its SM utilisation (percent) and
    used memory (bytes) are the step's (None in a step: unchanged). Captures have none."""

    def at(self, seconds: float) -> tuple[int | None, int | None] | None:
        """``(sm_utilization_percent, used_memory_bytes)`` ``seconds`` after the first ``nvmlInit``,
        or None when the process is not running then."""
        if seconds < self.start_s or (self.end_s is not None and seconds >= self.end_s):
            return None
        sm, used = self.sm_utilization_percent, self.used_memory_bytes
        for at_s, step_sm, step_used in self.steps:
            if at_s > seconds:
                break
            sm = step_sm if step_sm is not None else sm
            used = step_used if step_used is not None else used
        return sm, used


@dataclass(frozen=True)
class MigCapture:
    """One ``<mig_device>``: NVML MIG-device slot ``index``, GPU/compute instance ids, SM count,
    memory in bytes. ``profile`` and ``uuid`` come only from scenarios (the XML has neither)."""

    index: int
    gpu_instance_id: int
    compute_instance_id: int = 0
    sm_count: int | None = None
    memory_total_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    bar1_total_bytes: int | None = None
    bar1_used_bytes: int | None = None
    bar1_free_bytes: int | None = None
    profile: str | None = None
    uuid: str | None = None
    gpm: tuple[tuple[int, float], ...] | None = None  # (NVML_GPM_METRIC_* id, value); None: no GPM


@dataclass(frozen=True)
class NvLinkCapture:
    """One NVLink link of a scenario ``[[gpu.nvlink]]``: ``up`` its state, data counters in KiB (as
    NVML's THROUGHPUT_DATA fields answer), error counters by nvmlNvLinkErrorCounter_t."""

    link: int
    up: bool = True
    throughput_data_tx: int = 0
    throughput_data_rx: int = 0
    crc_flit_errors: int = 0
    replay_errors: int = 0
    recovery_errors: int = 0


@dataclass(frozen=True)
class XidCapture:
    """An XID the GPU reports (nvmlEventTypeXidCriticalError, ``xid`` its eventData) ``at_s`` seconds
    after the first ``nvmlInit``; MIG instance ids None for the whole GPU. Scenarios only."""

    xid: int
    at_s: float = 0.0
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True)
class GpuCapture:
    """Every value of one ``<gpu>`` the replay answers from, in NVML's units (see module docstring).

    Field names say their unit (``_bytes``, ``_mw``, ``_mhz``, ``_kbps``); modes are NVML's ints
    (enabled 1 / disabled 0, compute mode 0-3, P-state number); ``clock_reasons`` is the
    nvmlClocksEventReason bitmask; ECC totals sum the SRAM and DRAM counters of one scope.
    """

    name: str | None = None
    architecture: str | None = None
    uuid: str | None = None
    serial: str | None = None
    minor: int | None = None
    vbios_version: str | None = None
    board_part_number: str | None = None
    display_mode: int | None = None
    display_active: int | None = None
    persistence_mode: int | None = None
    mig_current: int | None = None
    mig_pending: int | None = None
    compute_mode: int | None = None
    pci_bus_id: str | None = None
    pci_domain: int | None = None
    pci_bus: int | None = None
    pci_device: int | None = None
    pci_device_id: int | None = None
    pci_subsystem_id: int | None = None
    pcie_gen_max: int | None = None
    pcie_gen_current: int | None = None
    pcie_width_max: int | None = None
    pcie_width_current: int | None = None
    pcie_replay_counter: int | None = None
    pcie_tx_kbps: int | None = None
    pcie_rx_kbps: int | None = None
    fan_speed_percent: int | None = None
    performance_state: int | None = None
    clock_reasons: int | None = None
    memory_total_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    bar1_total_bytes: int | None = None
    bar1_used_bytes: int | None = None
    bar1_free_bytes: int | None = None
    util_gpu_percent: int | None = None
    util_memory_percent: int | None = None
    util_encoder_percent: int | None = None
    util_decoder_percent: int | None = None
    ecc_current: int | None = None
    ecc_pending: int | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    remapped_corr: int | None = None
    remapped_unc: int | None = None
    remapped_pending: int | None = None
    remapped_failure: int | None = None
    temp_gpu_c: int | None = None
    temp_memory_c: int | None = None
    power_usage_mw: int | None = None
    power_average_mw: int | None = None
    power_instant_mw: int | None = None
    power_limit_enforced_mw: int | None = None
    power_limit_mw: int | None = None
    power_limit_default_mw: int | None = None
    power_limit_min_mw: int | None = None
    power_limit_max_mw: int | None = None
    clock_graphics_mhz: int | None = None
    clock_sm_mhz: int | None = None
    clock_mem_mhz: int | None = None
    clock_video_mhz: int | None = None
    max_clock_graphics_mhz: int | None = None
    max_clock_sm_mhz: int | None = None
    max_clock_mem_mhz: int | None = None
    max_clock_video_mhz: int | None = None
    retired_pages_sbe: tuple[int, ...] | None = None
    retired_pages_dbe: tuple[int, ...] | None = None
    processes: tuple[ProcessCapture, ...] = ()
    migs: tuple[MigCapture, ...] = ()
    process_samples: tuple[str, ...] = ("mean",)  # how nvmlDeviceGetProcessUtilization answers: "mean" | "every"
    deprecated: frozenset[str] = field(default_factory=frozenset)
    invalid: frozenset[str] = field(default_factory=frozenset)
    # the device's state over time (scenarios only; seconds after the first nvmlInit): it falls off the
    # bus at ``lost_at_s`` (every call naming it answers GPU_IS_LOST from then on), these calls answer
    # NVML_ERROR_<error> / block this many seconds first ("*": every call naming it), it reports these XIDs
    lost_at_s: float | None = None
    call_errors: tuple[tuple[str, str], ...] = ()
    call_hangs: tuple[tuple[str, float], ...] = ()
    xids: tuple[XidCapture, ...] = ()
    # GPM and NVLink (scenarios only): (NVML_GPM_METRIC_* id, value) answered between two samples (None:
    # not a GPM device, as every capture), and the NVLink links
    gpm: tuple[tuple[int, float], ...] | None = None
    nvlinks: tuple[NvLinkCapture, ...] = ()


# Largest values of NVML's C types: unsigned int, unsigned long long. A process's usedGpuMemory of
# 2^64-1 is NVML_VALUE_NOT_AVAILABLE (pynvml turns it into None), so a real value stays below it.
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
USED_MEMORY_MAX = U64 - 1
_U64_FIELDS = frozenset({f.name for f in fields(GpuCapture) if f.name.endswith("_bytes")} | {
    "clock_reasons", "ecc_volatile_corrected", "ecc_volatile_uncorrected", "ecc_aggregate_corrected",
    "ecc_aggregate_uncorrected"})


def int_max(name: str) -> int:
    """Largest value of the int :class:`GpuCapture` field ``name`` NVML's C type holds: unsigned
    long long (2^64-1) for bytes, ECC counts and the clock-reason mask, unsigned int (2^32-1) else."""
    return U64 if name in _U64_FIELDS else U32


@dataclass(frozen=True)
class SystemCapture:
    """A whole capture: driver version (str), CUDA driver version (``"13.0"``), GPUs in NVML order."""

    driver_version: str | None
    cuda_version: str | None
    gpus: tuple[GpuCapture, ...]


@dataclass(frozen=True)
class Scenario:
    """A loaded scenario: the capture it builds, the NVML functions it takes away from the driver's
    library, and the top-level tables left for the test support (name -> the TOML tables as read)."""

    capture: SystemCapture
    missing_functions: tuple[str, ...] = ()
    extra: dict[str, list[Any]] = field(default_factory=dict)


# -- value converters: text (already known not to be N/A) -> value, or None when it does not parse --
def _str(t: str) -> str:
    return t


# Numbers are at most _DIGITS digits long (longer ones are out of every NVML type's range anyway, and
# Python refuses to convert more than 4300); a minus sign is kept so that the range check rejects it.
_DIGITS = 40


def _int(t: str) -> int | None:
    m = re.fullmatch(rf"(-?\d{{1,{_DIGITS}}})\s*(x|%|C|MHz|KB/s|us)?", t)
    return int(m.group(1)) if m else None


def _hex(t: str) -> int | None:
    return int(t, 16) if re.fullmatch(rf"(0x)?[0-9A-Fa-f]{{1,{_DIGITS}}}", t) else None


def _bytes(t: str) -> int | None:
    m = re.fullmatch(rf"(-?\d{{1,{_DIGITS}}}(?:\.\d{{1,{_DIGITS}}})?)\s*(B|KiB|MiB|GiB)", t)
    return int(Decimal(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _mw(t: str) -> int | None:
    m = re.fullmatch(rf"(-?\d{{1,{_DIGITS}}}(?:\.\d{{1,{_DIGITS}}})?)\s*W", t)
    return int(Decimal(m.group(1)) * 1000) if m else None


def _bus_id(t: str) -> str | None:
    """A PCI bus id NVML could report (``DOMAIN:BUS:DEVICE.FUNCTION``), else None."""
    return t if pci_bus_id_parts(t) is not None else None


def _enabled(t: str) -> int | None:
    return {"enabled": 1, "disabled": 0}.get(t.lower())


def _yes(t: str) -> int | None:
    return {"yes": 1, "no": 0}.get(t.lower())


def _pstate(t: str) -> int | None:
    m = re.fullmatch(rf"P(\d{{1,{_DIGITS}}})", t)
    return int(m.group(1)) if m else None


def _compute_mode(t: str) -> int | None:
    modes = {"default": 0, "exclusive_thread": 1, "prohibited": 2, "exclusive_process": 3}
    return modes.get(t.lower())


_PW = ("gpu_power_readings", "power_readings")
_LINK = "pci/pci_gpu_link_info"
# field -> (element paths, first match wins; converter)
_FIELDS: dict[str, tuple[tuple[str, ...], Callable[[str], Any]]] = {
    "name": (("product_name",), _str),
    "architecture": (("product_architecture",), _str),
    "uuid": (("uuid",), _str),
    "serial": (("serial",), _str),
    "minor": (("minor_number",), _int),
    "vbios_version": (("vbios_version",), _str),
    "board_part_number": (("board_part_number",), _str),
    "display_mode": (("display_mode",), _enabled),
    "display_active": (("display_active",), _enabled),
    "persistence_mode": (("persistence_mode",), _enabled),
    "mig_current": (("mig_mode/current_mig",), _enabled),
    "mig_pending": (("mig_mode/pending_mig",), _enabled),
    "compute_mode": (("compute_mode",), _compute_mode),
    "pci_bus_id": (("pci/pci_bus_id",), _bus_id),
    "pci_domain": (("pci/pci_domain",), _hex),
    "pci_bus": (("pci/pci_bus",), _hex),
    "pci_device": (("pci/pci_device",), _hex),
    "pci_device_id": (("pci/pci_device_id",), _hex),
    "pci_subsystem_id": (("pci/pci_sub_system_id",), _hex),
    "pcie_gen_max": ((f"{_LINK}/pcie_gen/max_link_gen",), _int),
    "pcie_gen_current": ((f"{_LINK}/pcie_gen/current_link_gen",), _int),
    "pcie_width_max": ((f"{_LINK}/link_widths/max_link_width",), _int),
    "pcie_width_current": ((f"{_LINK}/link_widths/current_link_width",), _int),
    "pcie_replay_counter": (("pci/replay_counter",), _int),
    "pcie_tx_kbps": (("pci/tx_util",), _int),
    "pcie_rx_kbps": (("pci/rx_util",), _int),
    "fan_speed_percent": (("fan_speed",), _int),
    "performance_state": (("performance_state",), _pstate),
    **{f"memory_{k}_bytes": ((f"fb_memory_usage/{k}",), _bytes) for k in ("total", "reserved", "used", "free")},
    **{f"bar1_{k}_bytes": ((f"bar1_memory_usage/{k}",), _bytes) for k in ("total", "used", "free")},
    **{f"util_{k}_percent": ((f"utilization/{k}_util",), _int) for k in ("gpu", "memory", "encoder", "decoder")},
    "ecc_current": (("ecc_mode/current_ecc",), _enabled),
    "ecc_pending": (("ecc_mode/pending_ecc",), _enabled),
    "remapped_corr": (("remapped_rows/remapped_row_corr",), _int),
    "remapped_unc": (("remapped_rows/remapped_row_unc",), _int),
    "remapped_pending": (("remapped_rows/remapped_row_pending",), _yes),
    "remapped_failure": (("remapped_rows/remapped_row_failure",), _yes),
    "temp_gpu_c": (("temperature/gpu_temp",), _int),
    "temp_memory_c": (("temperature/memory_temp",), _int),
    # nvmlDeviceGetPowerUsage is the 1 s average on Ampere (except GA100) and newer, instantaneous on
    # GA100 and older (nvml.h); v13 captures give both, v11/v12 only ``power_draw``.
    "power_usage_mw": (tuple(f"{p}/{k}" for k in ("average_power_draw", "power_draw", "instant_power_draw")
                             for p in _PW), _mw),
    "power_average_mw": (tuple(f"{p}/average_power_draw" for p in _PW), _mw),
    "power_instant_mw": (tuple(f"{p}/{k}" for k in ("instant_power_draw", "power_draw") for p in _PW), _mw),
    "power_limit_enforced_mw": (tuple(f"{p}/{k}" for k in ("current_power_limit", "enforced_power_limit")
                                      for p in _PW), _mw),
    "power_limit_mw": (tuple(f"{p}/{k}" for k in ("requested_power_limit", "power_limit") for p in _PW), _mw),
    "power_limit_default_mw": (tuple(f"{p}/default_power_limit" for p in _PW), _mw),
    "power_limit_min_mw": (tuple(f"{p}/min_power_limit" for p in _PW), _mw),
    "power_limit_max_mw": (tuple(f"{p}/max_power_limit" for p in _PW), _mw),
    **{f"clock_{k}_mhz": ((f"clocks/{k}_clock",), _int) for k in ("graphics", "sm", "mem", "video")},
    **{f"max_clock_{k}_mhz": ((f"max_clocks/{k}_clock",), _int) for k in ("graphics", "sm", "mem", "video")},
}


class _Cells:
    """Reads the cells of one ``<gpu>``, noting the fields whose cells are deprecated or invalid.

    A cell is invalid when its text does not convert (``"warm"`` for a temperature) or converts to
    a number NVML's C type for that value cannot hold (``-36 C``; more than :func:`int_max`).
    """

    def __init__(self) -> None:
        self.deprecated: set[str] = set()
        self.invalid: set[str] = set()

    def read(self, el: ET.Element, paths: tuple[str, ...], conv: Callable[[str], Any], name: str,
             maximum: int = U32, *, note_deprecated: bool = False) -> Any:
        """The first of ``paths`` whose cell converts to a value in 0..``maximum`` (ints), else None."""
        value, state = _lookup(el, paths, conv, maximum)
        if state == "invalid":
            self.invalid.add(name)
        elif state == "deprecated" and note_deprecated:
            self.deprecated.add(name)
        return value


def _lookup(el: ET.Element, paths: tuple[str, ...], conv: Callable[[str], Any],
            maximum: int = U32) -> tuple[Any, str | None]:
    """(value, None) from the first path whose text converts to a value NVML's type holds (an int
    in 0..``maximum``); else (None, state): ``"invalid"`` when a cell held text that does not convert
    or a number out of range, ``"deprecated"`` when one said so, None when all are N/A or missing."""
    state = None
    for path in paths:
        node = el.find(path)
        if node is None:
            continue
        text = " ".join((node.text or "").split())
        if text.lower() == _DEPRECATED:
            state = state or "deprecated"
        elif text.lower() not in _ABSENT:
            value = conv(text)
            if value is not None and (not isinstance(value, int) or 0 <= value <= maximum):
                return value, None
            state = "invalid"
    return None, state


def _value(el: ET.Element, path: str, conv: Callable[[str], Any]) -> Any:
    return _lookup(el, (path,), conv)[0]


def _clock_reasons(gpu: ET.Element) -> int | None:
    """Bitmask of the reasons marked ``Active``; None when the capture has no reason cells."""
    mask, seen = 0, False
    for group, prefix in (("clocks_event_reasons", "clocks_event_reason_"),
                          ("clocks_throttle_reasons", "clocks_throttle_reason_")):
        el = gpu.find(group)
        for child in el if el is not None else ():
            bit = CLOCK_REASON_BITS.get(child.tag.removeprefix(prefix))
            state = (child.text or "").strip().lower()
            if bit is not None and state in ("active", "not active"):
                seen = True
                mask |= bit if state == "active" else 0
    return mask if seen else None


def _ecc_totals(gpu: ET.Element, scope: str, cells: _Cells) -> tuple[int | None, int | None]:
    """(corrected, uncorrected) of ``ecc_errors/<scope>``: the sum of its SRAM and DRAM cells
    (v11+), or ``single_bit/total`` and ``double_bit/total`` (older schemas); None if any is N/A
    or invalid, or the sum exceeds an unsigned long long."""
    el = gpu.find(f"ecc_errors/{scope}")
    if el is None:
        return None, None
    names = (f"ecc_{scope}_corrected", f"ecc_{scope}_uncorrected")
    if el.find("single_bit/total") is not None:
        return (cells.read(el, ("single_bit/total",), _int, names[0], U64),
                cells.read(el, ("double_bit/total",), _int, names[1], U64))
    out: list[int | None] = []
    for name, pattern in zip(names, (r"(sram|dram)_correctable", r"(sram|dram)_uncorrectable(_\w+)?"), strict=True):
        values = [cells.read(el, (c.tag,), _int, name, U64) for c in el if re.fullmatch(pattern, c.tag)]
        known = [v for v in values if v is not None]
        total = sum(known) if known and len(known) == len(values) else None
        if total is not None and total > U64:
            cells.invalid.add(name)
            total = None
        out.append(total)
    return out[0], out[1]


def _retired(gpu: ET.Element, cause: str, name: str, cells: _Cells) -> tuple[int, ...] | None:
    """Retired page addresses for one cause; None when the count is N/A (row-remapping GPUs) or
    a count or address is out of range (invalid)."""
    base = f"retired_pages/{cause}"
    if cells.read(gpu, (f"{base}/retired_count",), _int, name) is None:
        return None
    pages = gpu.find(f"{base}/retired_pagelist")
    addresses = tuple(int(n.text.strip(), 16) for n in (pages.iter() if pages is not None else ())
                      if n.text and re.fullmatch(r"\s*0x[0-9A-Fa-f]+\s*", n.text))
    if any(a > U64 for a in addresses):
        cells.invalid.add(name)
        return None
    return addresses


def process_types(code: str) -> frozenset[str]:
    """nvidia-smi process type (``C``, ``G``, ``C+G``, ``M+C``, ``M``) → NVML process lists."""
    parts = set(code.upper().split("+"))
    if "M" in parts:
        return frozenset({"mps"})
    return frozenset({"compute"} if "C" in parts else set()) | frozenset({"graphics"} if "G" in parts else set())


def _processes(gpu: ET.Element, cells: _Cells) -> tuple[ProcessCapture, ...]:
    """``<process_info>`` elements; one whose pid is N/A or invalid is left out."""
    procs = []
    for i, p in enumerate(gpu.iterfind("processes/process_info")):
        where = f"processes[{i}]"
        pid = cells.read(p, ("pid",), _int, f"{where}.pid")
        if pid is not None:
            procs.append(ProcessCapture(
                pid=pid, types=process_types(_value(p, "type", _str) or "C"),
                used_memory_bytes=cells.read(p, ("used_memory",), _bytes, f"{where}.used_memory_bytes",
                                             USED_MEMORY_MAX),
                gpu_instance_id=cells.read(p, ("gpu_instance_id",), _int, f"{where}.gpu_instance_id"),
                compute_instance_id=cells.read(p, ("compute_instance_id",), _int, f"{where}.compute_instance_id"),
                name=_value(p, "process_name", _str) or ""))
    return tuple(procs)


def _migs(gpu: ET.Element, cells: _Cells) -> tuple[MigCapture, ...]:
    migs: list[MigCapture] = []
    for i, m in enumerate(gpu.iterfind("mig_devices/mig_device")):
        mem, bar1 = ({k: cells.read(m, (f"{group}/{k}",), _bytes, f"migs[{i}].{prefix}_{k}_bytes", U64) for k in keys}
                     for group, prefix, keys in (("fb_memory_usage", "memory", ("total", "reserved", "used", "free")),
                                                 ("bar1_memory_usage", "bar1", ("total", "used", "free"))))
        ids = {k: cells.read(m, (path,), _int, f"migs[{i}].{k}") for k, path in (
            ("index", "index"), ("gpu_instance_id", "gpu_instance_id"),
            ("compute_instance_id", "compute_instance_id"),
            ("sm_count", "device_attributes/shared/multiprocessor_count"))}
        migs.append(MigCapture(
            index=len(migs) if ids["index"] is None else ids["index"],
            gpu_instance_id=ids["gpu_instance_id"] or 0,
            compute_instance_id=ids["compute_instance_id"] or 0,
            sm_count=ids["sm_count"],
            memory_total_bytes=mem["total"], memory_reserved_bytes=mem["reserved"],
            memory_used_bytes=mem["used"], memory_free_bytes=mem["free"],
            bar1_total_bytes=bar1["total"], bar1_used_bytes=bar1["used"], bar1_free_bytes=bar1["free"]))
    return tuple(migs)


def parse_gpu(gpu: ET.Element) -> GpuCapture:
    """One ``<gpu>`` element → :class:`GpuCapture` (see the module docstring for units, N/A and invalid cells)."""
    values: dict[str, Any] = {}
    cells = _Cells()
    for name, (paths, conv) in _FIELDS.items():
        values[name] = cells.read(gpu, paths, conv, name, int_max(name), note_deprecated=True)
    if values["pci_bus_id"] is None and "pci_bus_id" not in cells.invalid:
        values["pci_bus_id"] = _bus_id(gpu.get("id") or "")
    for scope in ("volatile", "aggregate"):
        values[f"ecc_{scope}_corrected"], values[f"ecc_{scope}_uncorrected"] = _ecc_totals(gpu, scope, cells)
    return GpuCapture(
        **values, clock_reasons=_clock_reasons(gpu),
        retired_pages_sbe=_retired(gpu, "multiple_single_bit_retirement", "retired_pages_sbe", cells),
        retired_pages_dbe=_retired(gpu, "double_bit_retirement", "retired_pages_dbe", cells),
        processes=_processes(gpu, cells), migs=_migs(gpu, cells),
        deprecated=frozenset(cells.deprecated), invalid=frozenset(cells.invalid))


def parse_capture(path: str | Path) -> SystemCapture:
    """Parse an ``nvidia-smi -q -x`` file: every ``<gpu>`` in document order (NVML index = position).

    Raises CaptureError naming the file and the 1-based line and column when the file is not
    well-formed XML (or names an encoding the parser cannot use), when its root element is not
    ``<nvidia_smi_log>``, or naming the ``<gpu>`` (NVML index and line) when a GPU has no UUID
    (``<uuid>`` missing, empty or N/A: NVML always reports one); OSError when unreadable. A GPU with
    the UUID of an earlier one (a sanitised capture) gets a distinct one (:func:`distinct_uuid`),
    with one warning line naming both GPUs and the UUID used.
    """
    system, shared = _read_capture(path)
    for i, message in shared.items():
        log.warning("%s; replaying it as %r", message, system.gpus[i].uuid)
    return system


def distinct_uuid(uuid: str, index: int) -> str:
    """The UUID replayed for the ``<gpu>`` at NVML index ``index`` whose ``uuid`` an earlier GPU of the
    capture has: ``GPU-`` + uuid5(NAMESPACE_OID, "<uuid>/<index>") (8-4-4-4-12), stable across runs.
    NVML never reports two GPUs with one UUID, and tools key GPUs by it."""
    return f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_OID, f'{uuid}/{index}')}"


def _read_capture(path: str | Path) -> tuple[SystemCapture, dict[int, str]]:
    """:func:`parse_capture` without the warnings: the capture, and for each GPU whose UUID an earlier
    one has (its own replaced by :func:`distinct_uuid`), the line that says so."""
    path = Path(path)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        line, column = exc.position
        reason = re.sub(r": line \d+, column \d+$", "", str(exc))
        raise CaptureError(f"{path}: line {line}, column {column + 1}: not well-formed XML ({reason})") from exc
    except (LookupError, ValueError) as exc:  # the encoding the XML declaration names: unknown, multi-byte, ...
        raise CaptureError(f"{path}: line 1: not well-formed XML (cannot decode it as the encoding its XML "
                           f"declaration names: {exc})") from exc
    if root.tag != "nvidia_smi_log":
        raise CaptureError(f"{path}: root element is <{root.tag}>, expected <nvidia_smi_log> "
                           "(the output of `nvidia-smi -q -x`)")
    gpus = [parse_gpu(g) for g in root.iterfind("gpu")]
    guessed = []
    for i, gpu in enumerate(gpus):
        chip = chip_for(gpu.pci_device_id) if gpu.architecture is None else None
        if chip is not None:
            gpus[i] = replace(gpu, architecture=chip.architecture)
            guessed.append(f"NVML index {i}: {chip.name}, {chip.architecture} "
                           f"{'.'.join(map(str, chip.compute_capability))}")
    if guessed:
        log.warning("%s: no <product_architecture>; architecture and compute capability guessed from the PCI "
                    "device id (%s)", path, "; ".join(guessed))
    seen: dict[str, int] = {}
    shared: dict[int, str] = {}
    for i, gpu in enumerate(gpus):
        if gpu.uuid is None or gpu.uuid in seen:
            lines = _gpu_lines(path)
            at = f"line {lines[i]}: " if i < len(lines) else ""
            if gpu.uuid is None:
                raise CaptureError(f"{path}: {at}the <gpu> at NVML index {i} has no UUID (<uuid> missing, "
                                   "empty or N/A); NVML always reports one")
            j = seen[gpu.uuid]
            shared[i] = (f"{path}: {at}the <gpu> at NVML index {i} has uuid {gpu.uuid!r}, as has the <gpu> at "
                         f"NVML index {j}{f' (line {lines[j]})' if j < len(lines) else ''}; NVML never reports "
                         "two equal UUIDs")
            gpus[i] = replace(gpu, uuid=distinct_uuid(gpu.uuid, i))
        seen.setdefault(gpus[i].uuid or "", i)
    return SystemCapture(
        driver_version=_value(root, "driver_version", _str),
        cuda_version=_value(root, "cuda_version", _str),
        gpus=tuple(gpus)), shared


def _gpu_lines(path: Path) -> list[int]:
    """The line of each ``<gpu>`` start tag under the root, in NVML index order (fewer if unknown).

    Only for error messages: a second expat pass over the file (ElementTree keeps no line numbers).
    """
    lines: list[int] = []
    parser = expat.ParserCreate(namespace_separator="}")  # as ElementTree: {uri}gpu is not <gpu>
    depth = 0

    def start(name: str, attrs: Any) -> None:
        nonlocal depth
        depth += 1
        if depth == 2 and name == "gpu":
            lines.append(parser.CurrentLineNumber)

    def end(name: str) -> None:
        nonlocal depth
        depth -= 1

    parser.StartElementHandler, parser.EndElementHandler = start, end
    with contextlib.suppress(expat.ExpatError, OSError, LookupError, ValueError):
        parser.Parse(path.read_bytes(), True)
    return lines


def pci_bus_id_parts(text: str) -> tuple[int, int, int, int] | None:
    """``"00000000:00:06.0"`` (any domain width) → (domain, bus, device, function); None if malformed."""
    m = re.fullmatch(r"([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])", text.strip())
    return (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4))) if m else None


# -- derived facts ---------------------------------------------------------------------------------
def compute_capability(gpu: GpuCapture) -> tuple[int, int] | None:
    """(major, minor): the chip's (:func:`collectors.replay.pci_chips.chip_for`, by PCI device id) when
    it is of the GPU's architecture, else from :data:`COMPUTE_CAPABILITY`; None for an architecture
    neither lists."""
    arch, name = (gpu.architecture or "").lower(), gpu.name or ""
    chip = chip_for(gpu.pci_device_id)
    if chip is not None and chip.architecture.lower() == arch:
        return chip.compute_capability
    for table_arch, pattern, cc in COMPUTE_CAPABILITY:
        if arch == table_arch and re.search(pattern, name):
            return cc
    return None


def architecture_code(gpu: GpuCapture) -> int:
    """NVML_DEVICE_ARCH_* for ``product_architecture``; NVML_DEVICE_ARCH_UNKNOWN when not listed."""
    return ARCHITECTURES.get((gpu.architecture or "").lower(), ARCH_UNKNOWN)


def mig_profile(parent: GpuCapture, mig: MigCapture) -> str:
    """MIG profile name ``<slices>g.<GB>gb``: the scenario's ``profile`` when given, else derived.

    Slices = SM count / :data:`MIG_SMS_PER_SLICE` (14 when the architecture is not listed), at
    least 1. GB = the instance's share of the parent's memory rounded to eighths, times the parent's
    nominal size ``ceil(total MiB / 1024)`` GB, rounded half up: A100-80GB 19968 MiB of 81920 MiB
    with 14 SMs → ``1g.20gb``; H200 (143771 MiB → 141 GB) 1/8 → ``1g.18gb``.
    """
    if mig.profile:
        return mig.profile
    per_slice = MIG_SMS_PER_SLICE.get((parent.architecture or "").lower(), 14)
    slices = max(1, round((mig.sm_count or per_slice) / per_slice))
    total, parent_total = mig.memory_total_bytes or 0, parent.memory_total_bytes or 0
    if not parent_total:
        return f"{slices}g.{round(total / 1e9)}gb"
    eighths = max(1, round(8 * total / parent_total))
    nominal = math.ceil(parent_total / (1 << 30))
    return f"{slices}g.{math.floor(nominal * eighths / 8 + 0.5)}gb"


# -- scenarios ---------------------------------------------------------------------------------------
MAX_HANG_SECONDS = 365 * 86400  # a year; time.sleep refuses from about 9.2e9 s (OverflowError / EINVAL)
_GPU_KEYS = {"capture", "capture_index", "index", "minor", "uuid", "name", "pci_bus_id", "override", "process", "mig",
             "process_samples", "lost_at_s", "errors", "hangs", "xid", "gpm", "nvlink"}
_XID_KEYS = {"xid", "at_s", "gpu_instance_id", "compute_instance_id"}
PROCESS_SAMPLE_SHAPES = ("mean", "every")
_PROCESS_KEYS = {"pid", "used_memory_bytes", "sm_utilization_percent", "type", "name", "start_s", "end_s", "step"}
_STEP_KEYS = {"at_s", "used_memory_bytes", "sm_utilization_percent"}
_MIG_KEYS = {"gpu_instance_id", "compute_instance_id", "profile", "memory_total_bytes", "uuid", "process", "gpm"}
_NVLINK_KEYS = {"link", "state", "throughput_data_tx", "throughput_data_rx", "crc_flit_errors", "replay_errors",
                "recovery_errors"}
NVLINK_MAX_LINKS = 36  # nvml.h NVML_NVLINK_MAX_LINKS (pynvml's; 18 before R550)
_OVERRIDABLE = {f.name: f.type for f in fields(GpuCapture) if f.type in ("int | None", "str | None")}


class ScenarioTable:
    """One TOML table of a scenario, checked key by key; errors name the file and the key path
    (:class:`CaptureError`). ``allowed``: the keys it may hold."""

    def __init__(self, path: Path, where: str, data: Any, allowed: set[str]) -> None:
        self.path, self.where, self.data = path, where, data
        if not isinstance(data, dict):
            self.fail(f"expected a table, got {data!r}")
        for key in data:
            if key not in allowed:
                self.fail(f"unknown key {key!r} (known: {', '.join(sorted(allowed))})", key)

    def fail(self, message: str, key: str | None = None) -> NoReturn:
        raise CaptureError(f"{self.path}: {'.'.join(k for k in (self.where, key) if k)}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None, *, required: bool = False) -> Any:
        if key not in self.data:
            if required:
                self.fail("missing required key", key)
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            self.fail(f"expected {kind.__name__ if isinstance(kind, type) else 'a number'}, got {value!r}", key)
        if isinstance(value, (int, float)) and value < 0:
            self.fail(f"must not be negative, got {value!r}", key)
        return value

    def uint(self, key: str, maximum: int = U32, default: int | None = None, *, required: bool = False) -> Any:
        """An int in 0..``maximum`` (the C type NVML answers it in: :data:`U32` or :data:`U64`)."""
        value = self.get(key, int, default, required=required)
        if value is not None and value > maximum:
            kind = {U32: "an unsigned int", U64: "an unsigned long long"}.get(maximum)
            self.fail(f"must be at most {maximum}{f' (NVML answers it as {kind})' if kind else ''}, got {value}", key)
        return value

    def seconds(self, key: str) -> float:
        """A finite number of seconds in 0..:data:`MAX_HANG_SECONDS` (0 when absent; a year at most:
        ``hang_seconds``, a ``[gpu.hangs]`` entry)."""
        value = float(self.get(key, (int, float), 0))
        if not math.isfinite(value) or value > MAX_HANG_SECONDS:
            self.fail(f"must be a finite number of seconds, at most {MAX_HANG_SECONDS}, got {value!r}", key)
        return value

    def tables(self, key: str, allowed: set[str]) -> list[ScenarioTable]:
        items = self.data.get(key, [])
        if not isinstance(items, list):
            self.fail("expected an array of tables ([[...]])", key)
        return [ScenarioTable(self.path, f"{self.where}.{key}[{i}]" if self.where else f"{key}[{i}]", t, allowed)
                for i, t in enumerate(items)]


def _process(t: ScenarioTable, gi: int | None = None, ci: int | None = None) -> ProcessCapture:
    kind = t.get("type", str, "compute")
    if kind not in ("compute", "graphics", "mps"):
        t.fail(f"expected 'compute', 'graphics' or 'mps', got {kind!r}", "type")
    sm = _sm_percent(t)
    used = _used_memory(t)
    start = _seconds(t, "start_s", 0.0) or 0.0
    end = _seconds(t, "end_s", None)
    if end is not None and end <= start:
        t.fail(f"need start_s < end_s, got {start!r} and {end!r}", "end_s")
    steps: list[tuple[float, int | None, int | None]] = []
    for step in t.tables("step", _STEP_KEYS):
        at_s = _seconds(step, "at_s", None, required=True)
        assert at_s is not None
        if steps and at_s <= steps[-1][0]:
            step.fail(f"steps must be in time order, got {at_s!r} after {steps[-1][0]!r}", "at_s")
        steps.append((at_s, _sm_percent(step), _used_memory(step)))
    return ProcessCapture(pid=t.uint("pid", required=True), types=frozenset({kind}),
                          used_memory_bytes=used, gpu_instance_id=gi,
                          compute_instance_id=ci, sm_utilization_percent=sm, name=t.get("name", str, ""),
                          start_s=start, end_s=None if end is None else float(end), steps=tuple(steps))


SCENARIO_SECONDS_MAX = 10 * 365 * 86400.0  # a timeline longer than ten years is a typo


def _seconds(t: ScenarioTable, key: str, default: float | None, *, required: bool = False) -> float | None:
    """A timeline key in seconds after nvmlInit: a finite number 0 .. :data:`SCENARIO_SECONDS_MAX`."""
    value = t.get(key, (int, float), default, required=required)
    if value is None:
        return None
    if isinstance(value, bool) or not math.isfinite(value) or not 0 <= value <= SCENARIO_SECONDS_MAX:
        t.fail(f"must be a number of seconds from 0 to {SCENARIO_SECONDS_MAX:g}, got {value!r}", key)
    return float(value)


def _sm_percent(t: ScenarioTable) -> int | None:
    sm = t.get("sm_utilization_percent", int)
    if sm is not None and not 0 <= sm <= 100:
        t.fail(f"must be 0-100, got {sm}", "sm_utilization_percent")
    return sm  # type: ignore[no-any-return]


def _used_memory(t: ScenarioTable) -> int | None:
    used = t.uint("used_memory_bytes", U64)
    if used == U64:
        t.fail(f"{U64} is NVML_VALUE_NOT_AVAILABLE; leave the key out for an unknown amount", "used_memory_bytes")
    return used  # type: ignore[no-any-return]


def _set_pci_bus_id(t: ScenarioTable, key: str, text: str, changes: dict[str, Any]) -> None:
    """``changes`` for a scenario ``pci_bus_id``: the id (normalised) and its domain, bus and device."""
    parts = pci_bus_id_parts(text)
    if parts is None:
        t.fail(f"expected DOMAIN:BUS:DEVICE.FUNCTION, got {text!r}", key)
    domain, bus, dev, fn = parts
    changes.update(pci_bus_id=f"{domain:08X}:{bus:02X}:{dev:02X}.{fn}", pci_domain=domain, pci_bus=bus, pci_device=dev)


def _set_uuid(t: ScenarioTable, key: str, text: str, changes: dict[str, Any]) -> None:
    if not text.strip() or text.strip().lower() in _ABSENT:
        t.fail(f"a GPU always has a UUID in NVML, got {text!r}", key)
    changes["uuid"] = text


def _merge(procs: Sequence[ProcessCapture], extra: Sequence[ProcessCapture]) -> tuple[ProcessCapture, ...]:
    """Capture processes plus scenario ones; a scenario process replaces one with the same pid and type."""
    replaced = {(p.pid, k) for p in extra for k in p.types}
    kept = [replace(p, types=p.types - {k for pid, k in replaced if pid == p.pid}) for p in procs]
    return (*[p for p in kept if p.types], *extra)


def _call_table(t: ScenarioTable, key: str, calls: Collection[str]) -> dict[str, Any]:
    """``[gpu.errors]`` / ``[gpu.hangs]``: a table keyed by NVML call names (or ``"*"``); ``calls``:
    the names the replay answers (empty: any ``nvml…`` name)."""
    table = t.get(key, dict, {})
    for call in table:
        if call != "*" and not (call in calls if calls else re.fullmatch(r"nvml\w+", call)):
            t.fail(f"{call!r} is not an NVML call the replay answers (or '*')", f"{key}.{call}")
    return table  # type: ignore[no-any-return]


def _device_state(t: ScenarioTable, calls: Collection[str], migs: Sequence[MigCapture]) -> dict[str, Any]:
    """The GpuCapture changes of a ``[[gpu]]``'s device-state keys: ``lost_at_s``, ``[gpu.errors]``,
    ``[gpu.hangs]``, ``[[gpu.xid]]`` (module docstring)."""
    changes: dict[str, Any] = {}
    if "lost_at_s" in t.data:
        changes["lost_at_s"] = _seconds(t, "lost_at_s", None)
    errors = []
    for call, error in _call_table(t, "errors", calls).items():
        if not isinstance(error, str) or error not in NVML_ERRORS:
            t.fail(f"expected an NVML error name without NVML_ERROR_ (e.g. \"NO_PERMISSION\"), got {error!r}",
                   f"errors.{call}")
        errors.append((call, error))
    hangs = []
    for call in _call_table(t, "hangs", calls):
        hang = ScenarioTable(t.path, f"{t.where}.hangs", t.data["hangs"], set(t.data["hangs"])).seconds(call)
        hangs.append((call, hang))
    xids = []
    for x in t.tables("xid", _XID_KEYS):
        xid = x.uint("xid", U64, required=True)
        if xid == 0:
            x.fail("XIDs are numbered from 1, got 0", "xid")
        gi, ci = x.uint("gpu_instance_id"), x.uint("compute_instance_id")
        if ci is not None and gi is None:
            x.fail("given without gpu_instance_id", "compute_instance_id")
        if gi is not None and not any(m.gpu_instance_id == gi and ci in (None, m.compute_instance_id) for m in migs):
            have = ", ".join(f"{m.gpu_instance_id}/{m.compute_instance_id}" for m in migs)
            x.fail(f"this GPU has no MIG instance {gi}{'' if ci is None else f'/{ci}'} "
                   f"({f'gpu/compute instance ids: {have}' if have else 'MIG is not enabled'})",
                   "gpu_instance_id" if ci is None else "compute_instance_id")
        xids.append(XidCapture(xid=xid, at_s=_seconds(x, "at_s", 0.0) or 0.0, gpu_instance_id=gi,
                               compute_instance_id=ci))
    return {**changes, "call_errors": tuple(errors), "call_hangs": tuple(hangs), "xids": tuple(xids)}


def _gpu(t: ScenarioTable, base: Path, captures: dict[Path, tuple[SystemCapture, dict[int, str]]],
         calls: Collection[str] = ()) -> tuple[int | None, GpuCapture]:
    """One ``[[gpu]]`` → (requested NVML index or None, its capture with the scenario applied). A GPU
    whose UUID an earlier one of its capture has is warned about only when the scenario gives it none."""
    file = base / t.get("capture", str, required=True)
    if file not in captures:
        try:
            is_file = stat.S_ISREG(file.stat().st_mode)
        except FileNotFoundError:
            t.fail(f"capture file {file} does not exist", "capture")
        except (OSError, ValueError) as exc:  # ValueError: a NUL character in the name
            t.fail(f"cannot read capture file {file}: {getattr(exc, 'strerror', None) or exc}", "capture")
        if not is_file:
            t.fail(f"capture file {file} is not a file{' (a directory)' if file.is_dir() else ''}", "capture")
        try:
            captures[file] = _read_capture(file)
        except CaptureError as exc:
            t.fail(f"bad capture: {exc}", "capture")
        except OSError as exc:
            t.fail(f"cannot read capture file {file}: {exc.strerror or exc}", "capture")
    system, shared = captures[file]
    pick = t.get("capture_index", int, 0)
    if pick >= len(system.gpus):
        t.fail(f"{file} holds {len(system.gpus)} <gpu> element(s); index {pick} is out of range", "capture_index")
    gpu = system.gpus[pick]
    changes: dict[str, Any] = {}
    if "minor" in t.data:
        changes["minor"] = t.uint("minor", int_max("minor"))
    if "name" in t.data:
        changes["name"] = t.get("name", str)
    if "uuid" in t.data:
        _set_uuid(t, "uuid", t.get("uuid", str), changes)
    if "pci_bus_id" in t.data:
        _set_pci_bus_id(t, "pci_bus_id", t.get("pci_bus_id", str), changes)
    if "process_samples" in t.data:
        shape = t.get("process_samples", str)
        if shape not in PROCESS_SAMPLE_SHAPES:
            t.fail(f"must be one of {', '.join(map(repr, PROCESS_SAMPLE_SHAPES))}, got {shape!r}", "process_samples")
        changes["process_samples"] = (shape,)
    if "override" in t.data:
        o = ScenarioTable(t.path, f"{t.where}.override", t.data["override"], set(_OVERRIDABLE))
        for key, value in o.data.items():
            if key == "uuid":
                _set_uuid(o, key, o.get(key, str), changes)
            elif value == "N/A":
                changes[key] = None
            elif key == "pci_bus_id":
                _set_pci_bus_id(o, key, o.get(key, str), changes)
            elif _OVERRIDABLE[key].startswith("int"):
                changes[key] = o.uint(key, int_max(key))
            else:
                changes[key] = o.get(key, str)
    extra = [_process(p) for p in t.tables("process", _PROCESS_KEYS)]
    migs = t.tables("mig", _MIG_KEYS)
    if migs:
        changes.update(mig_current=1, mig_pending=1, migs=tuple(_mig(m, i) for i, m in enumerate(migs)))
        extra += [_process(p, m.data["gpu_instance_id"], m.data.get("compute_instance_id", 0))
                  for m in migs for p in m.tables("process", _PROCESS_KEYS)]
    listed = [(p.pid, kind) for p in extra for kind in p.types]
    twice = sorted({key for key in listed if listed.count(key) > 1})
    if twice:  # the same PID in two lists ("C+G": compute and graphics) is one process; twice in one is not
        t.fail(f"PID {twice[0][0]} is given twice as a {twice[0][1]} process on this GPU", "process")
    # a value the scenario sets (``migs``: all of them) is no longer the capture's deprecated or invalid
    # cell; scenario processes are added to the capture's, whose invalid cells stay listed
    changes.update({k: frozenset(n for n in getattr(gpu, k) if re.split(r"[\[.]", n)[0] not in changes)
                    for k in ("deprecated", "invalid")})
    changes["processes"] = _merge(gpu.processes, extra)
    changes.update(_device_state(t, calls, changes.get("migs", gpu.migs)))
    if "gpm" in t.data:
        changes["gpm"] = gpm_table(t, "gpm")
    if "nvlink" in t.data:
        changes["nvlinks"] = _nvlinks(t)
    if pick in shared and "uuid" not in changes:
        log.warning("%s; replaying it as %r (%s)", shared[pick], gpu.uuid, t.where)
    return t.get("index", int), replace(gpu, **changes)


def _mig(t: ScenarioTable, index: int) -> MigCapture:
    total = t.uint("memory_total_bytes", U64, required=True)
    used = sum(_process(p).used_memory_bytes or 0 for p in t.tables("process", _PROCESS_KEYS))
    if used > U64:
        t.fail(f"its processes use {used} bytes, more than an unsigned long long holds", "process")
    return MigCapture(index=index, gpu_instance_id=t.uint("gpu_instance_id", required=True),
                      compute_instance_id=t.uint("compute_instance_id", default=0),
                      profile=t.get("profile", str, required=True), uuid=t.get("uuid", str),
                      memory_total_bytes=total, memory_reserved_bytes=0, memory_used_bytes=used,
                      memory_free_bytes=max(0, total - used),
                      gpm=gpm_table(t, "gpm") if "gpm" in t.data else None)


def gpm_metric_ids() -> dict[str, int]:
    """Scenario ``[gpu.gpm]`` key -> metric id: every ``NVML_GPM_METRIC_<NAME>`` constant of pynvml
    (but ``_MAX``), the key being ``<name>`` in lower case (``sm_util`` -> 2)."""
    import pynvml  # the replay's only source of NVML's constants

    return {k.removeprefix("NVML_GPM_METRIC_").lower(): int(v) for k, v in vars(pynvml).items()
            if k.startswith("NVML_GPM_METRIC_") and k != "NVML_GPM_METRIC_MAX"}


def gpm_table(t: ScenarioTable, key: str) -> tuple[tuple[int, float], ...]:
    """A ``[gpu.gpm]`` / ``[gpu.mig.gpm]`` table: metric names (:func:`gpm_metric_ids`) to finite,
    non-negative numbers; a percentage (every metric whose name does not end in ``per_sec``) at most 100."""
    ids = gpm_metric_ids()
    table = ScenarioTable(t.path, f"{t.where}.{key}", t.data[key], set(ids))
    out = []
    for name in table.data:
        value = float(table.get(name, (int, float)))
        if not math.isfinite(value):
            table.fail(f"must be a finite number, got {value!r}", name)
        if not name.endswith("per_sec") and name.endswith(("util", "occupancy")) and value > 100:
            table.fail(f"a percentage: must be 0-100, got {value!r}", name)
        out.append((ids[name], value))
    return tuple(sorted(out))


def _nvlinks(t: ScenarioTable) -> tuple[NvLinkCapture, ...]:
    links: list[NvLinkCapture] = []
    for n in t.tables("nvlink", _NVLINK_KEYS):
        link = n.uint("link", NVLINK_MAX_LINKS - 1, required=True)
        if any(k.link == link for k in links):
            n.fail(f"link {link} is given twice", "link")
        state = n.get("state", str, "up")
        if state not in ("up", "down"):
            n.fail(f"expected 'up' or 'down', got {state!r}", "state")
        links.append(NvLinkCapture(
            link=link, up=state == "up",
            **{k: n.uint(k, U64, 0) for k in sorted(_NVLINK_KEYS - {"link", "state"})}))
    return tuple(links)


def load_scenario(path: str | Path, *, tables: Collection[str] = (), calls: Collection[str] = ()) -> Scenario:
    """Read a scenario TOML (keys: the module docstring) into GPUs in NVML index order. ``tables``:
    other top-level tables to accept unread (:attr:`Scenario.extra`); ``calls``: the NVML call names
    ``[gpu.errors]`` and ``[gpu.hangs]`` may name (empty: any ``nvml…`` name). The driver and CUDA versions
    are those of the first capture file named, unless ``driver_version`` says otherwise. Raises
    CaptureError naming the file and the line and column (malformed TOML), the line and byte offset
    (not UTF-8), the OS reason (unreadable) or the key (unknown key, wrong type, a value out of its
    range: negative, beyond the NVML C type's (:func:`int_max`); a capture that is missing, not a
    file, unreadable or rejected by :func:`parse_capture`, ``capture_index`` out of range, duplicate
    index/uuid/minor, an empty uuid, a ``driver_version`` without a major number).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode())
    except OSError as exc:
        raise CaptureError(f"cannot read scenario {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise CaptureError(f"{path}: line {line}, byte offset {exc.start}: not UTF-8 text ({exc.reason}; "
                           "TOML is UTF-8)") from exc
    except RecursionError as exc:
        raise CaptureError(f"{path}: not valid TOML (arrays or tables nested too deeply)") from exc
    except tomllib.TOMLDecodeError as exc:
        text = str(exc)
        m = re.search(r"\(at line (\d+), column (\d+)\)$", text)
        if m:
            where = f"line {m.group(1)}, column {m.group(2)}"
        else:  # "(at end of document)"
            lines = raw.decode().split("\n")
            where = f"line {len(lines)}, column {len(lines[-1]) + 1}"
        reason = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)$", "", text)
        raise CaptureError(f"{path}: {where}: not valid TOML ({reason})") from exc
    except ValueError as exc:  # an integer of more than 4300 digits (sys.get_int_max_str_digits)
        raise CaptureError(f"{path}: not valid TOML ({str(exc).split(';')[0]})") from exc
    if "fault" in data and "fault" not in tables:
        raise CaptureError(f"{path}: [[fault]]: call-counting fault injection is test support "
                           "(tests/support/replay_faults.py), not part of accelstats; a GPU's own failures are its "
                           "[[gpu]] keys lost_at_s, [gpu.errors], [gpu.hangs] and [[gpu.xid]] (docs/replay.md)")
    top = ScenarioTable(path, "", data, {"gpu", "driver_version", "missing_functions", *tables})
    extra: dict[str, list[Any]] = {}
    for name in tables:
        if name in data:
            if not isinstance(data[name], list):
                top.fail("expected an array of tables ([[...]])", name)
            extra[name] = data[name]
    captures: dict[Path, tuple[SystemCapture, dict[int, str]]] = {}
    gpu_tables = top.tables("gpu", _GPU_KEYS)
    entries = [_gpu(t, path.parent, captures, calls) for t in gpu_tables]
    order = [pos if index is None else index for pos, (index, _) in enumerate(entries)]
    if sorted(order) != list(range(len(entries))):
        top.fail(f"gpu indices {order} are not 0..{len(entries) - 1}, each once", "gpu")
    for key in ("uuid", "minor"):
        seen: dict[Any, str] = {}
        for (_, gpu), t in zip(entries, gpu_tables, strict=True):
            value = getattr(gpu, key)
            if value is not None and value in seen:
                t.fail(f"{key} {value!r} is also {seen[value]}'s; give each GPU its own", key)
            seen[value] = t.where
    by_index = dict(zip(order, (gpu for _, gpu in entries), strict=True))
    gpus = tuple(by_index[i] for i in range(len(entries)))
    first = next(iter(captures.values()), (SystemCapture(None, None, ()), {}))[0]
    driver = top.get("driver_version", str, first.driver_version)
    if driver is not None and not re.match(r"\d+(\.|$)", driver):
        top.fail(f"expected a driver version such as \"470.256.02\", got {driver!r}", "driver_version")
    missing = top.get("missing_functions", list, [])
    if not all(isinstance(m, str) and re.fullmatch(r"nvml\w+", m) for m in missing):
        top.fail(f"expected a list of NVML function names, got {missing!r}", "missing_functions")
    return Scenario(SystemCapture(driver, first.cuda_version, gpus), tuple(missing), extra)
