"""Plain data read from devices: what every collector returns and every sink renders.

Units are base units throughout (bytes, seconds, joules, watts, celsius, hertz, ratio 0-1). ``None``
means *absent*: NVML answered NOT_SUPPORTED, returned a "value not available" sentinel, or the
device has no such thing (MIG instances have no utilisation). Sinks skip absent values; they never
turn them into 0 or NaN (the metrics contract, conventions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

ProcessType = Literal["compute", "graphics", "mps"]
DeviceKind = Literal["gpu", "mig"]


@dataclass(frozen=True)
class Device:
    """Static identity of one NVIDIA GPU or MIG instance, resolved once per NVML session.

    ``index`` is the NVML index (``nvmlDeviceGetIndex``), ``minor`` the minor number of
    ``/dev/nvidia<minor>`` (``nvmlDeviceGetMinorNumber``; ``None`` for MIG instances, which share the
    parent's node). ``uuid`` (``GPU-…`` or ``MIG-…``) keys everything else.
    """

    uuid: str
    index: int
    minor: int | None
    name: str
    pci_bus_id: str = ""
    kind: DeviceKind = "gpu"
    parent_uuid: str = ""
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    mig_profile: str = ""
    vbios_version: str = ""
    mig_mode: str = ""  # "enabled" / "disabled" / "" (not supported)
    compute_mode: str = ""  # "default", "exclusive_process", "prohibited", ""
    persistence_mode: str = ""  # "enabled" / "disabled" / ""
    compute_capability: str = ""  # "9.0"
    architecture: str = ""  # "hopper"
    max_clocks_hz: tuple[tuple[str, float], ...] = ()  # (clock, hertz); cached: ~1.3 ms per call
    max_pcie_generation: int | None = None  # nvmlDeviceGetMaxPcieLinkGeneration
    max_pcie_width: int | None = None  # nvmlDeviceGetMaxPcieLinkWidth (lanes)
    display_mode: str = ""  # "enabled" / "disabled" / "" (nvmlDeviceGetDisplayMode: a display may be attached)


@dataclass(frozen=True)
class ProcessUsage:
    """One process on one device, as NVML lists it (host PID namespace).

    ``used_memory_bytes`` is NVML's ``usedGpuMemory`` (``None`` when NVML says "not available");
    ``sm_utilization_ratio`` is the mean of ``nvmlDeviceGetProcessUtilization`` samples for this PID
    since the previous collection (``None`` when the device does not report it); ``types``: every list
    NVML names it in (``type`` is the first; a "C+G" process is in the compute and the graphics list).
    """

    pid: int
    type: ProcessType
    used_memory_bytes: int | None = None
    sm_utilization_ratio: float | None = None
    types: tuple[ProcessType, ...] = ()


@dataclass(frozen=True)
class NvLinkReading:
    """One NVLink link of a GPU, read in the background (:mod:`collectors.nvlink`): ``up`` from
    ``nvmlDeviceGetNvLinkState`` (None: not answered), ``data_bytes`` ``(direction, bytes)`` counters
    from the THROUGHPUT_DATA fields (NVML's KiB x 1024; "tx" sent, "rx" received), ``errors``
    ``(type, count)`` from ``nvmlDeviceGetNvLinkErrorCounter`` ("crc_flit", "replay", "recovery")."""

    link: int
    up: bool | None = None
    data_bytes: tuple[tuple[str, int], ...] = ()
    errors: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class DeviceSample:
    """One reading of one device in one collection. ``up`` is False when the device did not answer
    (GPU lost, unknown error, call past the deadline); then ``error`` says why and all values are absent.
    """

    uuid: str
    up: bool
    error: str = ""
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    bar1_total_bytes: int | None = None
    bar1_used_bytes: int | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    temperatures_celsius: tuple[tuple[str, float], ...] = ()  # (sensor, celsius)
    clocks_hz: tuple[tuple[str, float], ...] = ()  # (clock, hertz)
    max_clocks_hz: tuple[tuple[str, float], ...] = ()  # (clock, hertz), from Device (read once)
    performance_state: int | None = None
    clock_events: tuple[tuple[str, bool], ...] = ()  # (reason, active)
    ecc_errors: tuple[tuple[str, str, int], ...] = ()  # (type, scope, count)
    remapped_rows: tuple[tuple[str, int], ...] = ()  # (type, rows)
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    pcie_link_generation: int | None = None
    pcie_link_width: int | None = None
    pcie_replays: int | None = None
    # (direction, bytes/s): "rx" host to GPU, "tx" GPU to host; read in the background (collectors/pcie.py)
    pcie_throughput_bytes_per_second: tuple[tuple[str, float], ...] = ()
    fan_speed_ratio: float | None = None
    # GPM profiling metrics over the last background interval (collectors/profiling.py): (family key, label
    # value or "", ratio 0-1); profiling_state: (state, reason), state "" when the sampler is off
    profiling: tuple[tuple[str, str, float], ...] = ()
    profiling_state: tuple[str, str] = ("", "")
    nvlinks: tuple[NvLinkReading, ...] = ()  # GPUs only; () also where the GPU has no NVLink
    xid_errors: tuple[tuple[int, int], ...] = ()  # (xid, count) since start: NVML critical-XID events
    xid_critical: int | None = None  # the last XID that makes the GPU unfit for work; 0: none; None: not watched
    processes: tuple[ProcessUsage, ...] | None = None  # None: no process list readable
    process_types: tuple[ProcessType, ...] = ()  # the types whose NVML process list answered


@dataclass(frozen=True)
class FileDevice:
    """A "file device" as Nomad's example device plugin models it: one regular file in a directory.

    ``id`` is the file name; ``permissions`` the 10-character ``ls -l`` string (``-rw-r--r--``);
    ``mode`` the permission bits (``st_mode & 0o7777``); ``healthy`` is False when ``permissions``
    equals the configured unhealthy string, and ``health_description`` then says so.
    """

    id: str
    path: str
    vendor: str
    type: str
    name: str
    healthy: bool
    health_description: str
    size_bytes: int
    modified_timestamp_seconds: float
    mode: int
    permissions: str


@dataclass(frozen=True)
class MpsDaemonReading:
    """One MPS control daemon as the ``mps`` collector saw it in this collection (docs/mps.md):
    ``up`` when ``get_default_active_thread_percentage`` answered within the timeout and parsed;
    ``pinned_memory_limit_bytes`` per GPU UUID (None: no limit set); ``device_clients``: (GPU UUID, client
    PID) pairs from ``get_device_client_list`` — attribution adds those NVML did not list as MPS
    processes (memory unknown), so every MPS client counts in its container."""

    resource: str
    up: bool
    reason: str = ""
    servers: int = 0
    clients: int = 0
    active_thread_ratio: float | None = None
    pinned_memory_limit_bytes: tuple[tuple[str, int | None], ...] = ()
    device_clients: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class KubeletAllocation:
    """One device the kubelet's pod-resources ``List`` assigned to one container (docs/kubernetes.md).

    Device plugins: ``resource`` (``nvidia.com/gpu``), ``device_id`` as the kubelet gave it, ``uuid``/``gpu``
    (NVML UUID and index, a MIG instance's parent's index) of the device it names on this host,
    ``parent_uuid`` a MIG instance's GPU ("" for a GPU), ``replica`` the sharing replica ("" when not
    shared). DRA claims: ``claim``, ``claim_namespace``, ``driver``, ``pool``, ``device`` set and ``resource``
    ""; ``uuid``/``gpu`` "" while the claimed device does not resolve to one of this host."""

    namespace: str
    pod: str
    container: str
    device_id: str = ""
    resource: str = ""
    uuid: str = ""
    gpu: str = ""
    parent_uuid: str = ""
    replica: str = ""
    claim: str = ""
    claim_namespace: str = ""
    driver: str = ""
    pool: str = ""
    device: str = ""


@dataclass(frozen=True)
class KubeletReading:
    """What the ``kubernetes`` collector read in one collection: ``up`` when ``List`` answered (then
    ``allocations`` is its answer), else ``reason`` says why not (one line); ``errors``: failed ``List``
    calls since start, per reason code (``accelstats.kubernetes.podresources.ErrorReason``)."""

    up: bool
    reason: str = ""
    allocations: tuple[KubeletAllocation, ...] = ()
    errors: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class CollectorResult:
    """How one collector run went (node_exporter's scrape_collector_success/duration pattern)."""

    name: str
    success: bool
    duration_seconds: float
    error: str = ""


@dataclass
class DeviceSnapshot:
    """Everything the device collectors read in one collection; filled by each collector's ``update``.

    ``nvml_status`` is "" while NVML is usable, else the reason it is not (library missing, driver
    not loaded); ``nvml_state`` is "" when the nvidia collector did not run, else ``ready``,
    ``no_device`` (no NVIDIA PCI device here: nothing to read) or ``unavailable`` (NVIDIA devices,
    but NVML does not work or answer); ``source`` is ``"nvml"`` for the live library and
    ``"replay"`` for the replay backend.
    """

    timestamp: float = field(default_factory=time.time)
    devices: list[Device] = field(default_factory=list)
    samples: dict[str, DeviceSample] = field(default_factory=dict)
    file_devices: list[FileDevice] = field(default_factory=list)
    file_devices_skipped_total: int = 0
    mps: list[MpsDaemonReading] = field(default_factory=list)
    kubelet: KubeletReading | None = None  # None: the kubernetes collector did not run or found no socket
    nvml_status: str = ""
    nvml_state: str = ""
    source: str = "nvml"
    driver_version: str = ""
    cuda_driver_version: str = ""
    nvml_version: str = ""
    collector_results: list[CollectorResult] = field(default_factory=list)
    last_success: dict[str, float] = field(default_factory=dict)
    """Per device UUID, the Unix time of the last NVML pass that read it (``up``): a sample older than
    the collection comes from an earlier pass (the device hangs or NVML is down)."""


class NoDataError(Exception):
    """Raised by a collector's ``update`` when there is nothing to read here (not a failure).

    The runner logs it at debug level and reports ``success`` 0, like node_exporter's ``ErrNoData``.
    """
