"""The catalog: every metric family accelstats publishes, declared once (the metrics contract).

Each :class:`Family` gives the exposition name, type, HELP text and label names; per-device
families also give how to read their values from a :class:`collectors.model.DeviceSample`. The
exporter only renders this table; ``tests/test_catalog.py`` checks it against the metrics contract.
Absent values (``None``) produce no sample (spec: "absent, never 0").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from collectors.model import DeviceSample

FamilyType = Literal["gauge", "counter"]
Reading = tuple[tuple[str, ...], float]  # (extra label values, value)
Reader = Callable[[DeviceSample], Iterable[Reading]]


@dataclass(frozen=True)
class Family:
    """One metric family: ``name`` as exposed (counters end in ``_total``), type, HELP and labels."""

    name: str
    type: FamilyType
    help: str
    labels: tuple[str, ...]
    read: Reader | None = None  # per-device families: extra label values and value from a sample


CADVISOR_LABELS = ("id", "name", "image", "container", "pod", "namespace", "make", "model", "acc_id")
CONTAINER_LABELS = ("id", "name", "image", "container", "pod", "namespace")
GPU_LABELS = ("uuid", "gpu", "model")
FILE_LABELS = ("device", "vendor", "type", "name", "path")
GPU_INFO_LABELS = GPU_LABELS + (
    "minor", "pci_bus_id", "kind", "parent_uuid", "mig_profile", "gpu_instance_id", "compute_instance_id",
    "driver_version", "cuda_driver_version", "vbios_version", "mig_mode", "compute_mode", "persistence_mode",
    "compute_capability", "architecture", "source",
)


def _scalar(attr: str, scale: float = 1.0) -> Reader:
    def read(sample: DeviceSample) -> Iterable[Reading]:
        value = getattr(sample, attr)
        if value is not None:
            yield (), float(value) * scale
    return read


def _pairs(attr: str, scale: float = 1.0) -> Reader:
    def read(sample: DeviceSample) -> Iterable[Reading]:
        for key, value in getattr(sample, attr):
            yield (str(key),), float(value) * scale
    return read


def _ecc(sample: DeviceSample) -> Iterable[Reading]:
    for etype, scope, count in sample.ecc_errors:
        yield (etype, scope), float(count)


def _flag(attr: str) -> Reader:
    def read(sample: DeviceSample) -> Iterable[Reading]:
        value = getattr(sample, attr)
        if value is not None:
            yield (), 1.0 if value else 0.0
    return read


def _process_counts(sample: DeviceSample) -> Iterable[Reading]:
    for ptype in sample.process_types:  # only the lists NVML answered: NOT_SUPPORTED stays absent
        yield (ptype,), float(sum(1 for p in sample.processes or () if p.type == ptype))


def _gpu(name: str, help_: str, read: Reader, extra: tuple[str, ...] = (),
         type_: FamilyType = "gauge") -> Family:
    return Family(name, type_, help_, GPU_LABELS + extra, read)


# --- §1 cAdvisor-compatible (exact names, HELP and labels) ---------------------------------------
CADVISOR_MEMORY_TOTAL = Family("container_accelerator_memory_total_bytes", "gauge",
                               "Total accelerator memory.", CADVISOR_LABELS)
CADVISOR_MEMORY_USED = Family("container_accelerator_memory_used_bytes", "gauge",
                              "Total accelerator memory allocated.", CADVISOR_LABELS)
CADVISOR_DUTY_CYCLE = Family(
    "container_accelerator_duty_cycle", "gauge",
    "Percent of time over the past sample period during which the accelerator was actively processing.",
    CADVISOR_LABELS)
CADVISOR = (CADVISOR_MEMORY_TOTAL, CADVISOR_MEMORY_USED, CADVISOR_DUTY_CYCLE)

# --- §2 per device --------------------------------------------------------------------------------
GPU_INFO = Family("accelstats_gpu_info", "gauge",
                  "Identity of an NVIDIA GPU or MIG instance (NVML); value 1.", GPU_INFO_LABELS)
GPU_UP = Family("accelstats_gpu_up", "gauge",
                "1 when the device answered NVML in this collection, 0 when lost or past the deadline.",
                GPU_LABELS)
GPU_LAST_SUCCESS = Family(
    "accelstats_gpu_last_success_timestamp_seconds", "gauge",
    "Unix time of the last collection that read the device through NVML; a reading older than the scrape "
    "interval is being served from an earlier collection (the device hangs, or NVML is down).", GPU_LABELS)
GPU_SAMPLED: tuple[Family, ...] = (
    _gpu("accelstats_gpu_utilization_ratio",
         "Mean GPU utilisation over NVML samples since the previous collection (0-1).",
         _scalar("utilization_ratio")),
    _gpu("accelstats_gpu_memory_utilization_ratio",
         "Fraction of the last sample period the memory controller was busy (0-1).",
         _scalar("memory_utilization_ratio")),
    _gpu("accelstats_gpu_encoder_utilization_ratio", "Video encoder utilisation (0-1).",
         _scalar("encoder_utilization_ratio")),
    _gpu("accelstats_gpu_decoder_utilization_ratio", "Video decoder utilisation (0-1).",
         _scalar("decoder_utilization_ratio")),
    _gpu("accelstats_gpu_memory_total_bytes", "Total framebuffer memory (NVML memory info v2).",
         _scalar("memory_total_bytes")),
    _gpu("accelstats_gpu_memory_used_bytes", "Used framebuffer memory (NVML memory info v2).",
         _scalar("memory_used_bytes")),
    _gpu("accelstats_gpu_memory_free_bytes", "Free framebuffer memory (NVML memory info v2).",
         _scalar("memory_free_bytes")),
    _gpu("accelstats_gpu_memory_reserved_bytes", "Framebuffer memory reserved by the driver (memory info v2).",
         _scalar("memory_reserved_bytes")),
    _gpu("accelstats_gpu_bar1_memory_total_bytes", "Total BAR1 memory.", _scalar("bar1_total_bytes")),
    _gpu("accelstats_gpu_bar1_memory_used_bytes", "Used BAR1 memory.", _scalar("bar1_used_bytes")),
    _gpu("accelstats_gpu_power_watts", "Power draw of the GPU board.", _scalar("power_watts")),
    _gpu("accelstats_gpu_power_limit_watts", "Enforced power limit.", _scalar("power_limit_watts")),
    _gpu("accelstats_gpu_energy_joules_total", "Energy consumed since the driver was loaded.",
         _scalar("energy_joules"), type_="counter"),
    _gpu("accelstats_gpu_temperature_celsius", "Temperature by sensor (gpu, memory).",
         _pairs("temperatures_celsius"), ("sensor",)),
    _gpu("accelstats_gpu_clock_hertz", "Current clock frequency by clock domain.", _pairs("clocks_hz"),
         ("clock",)),
    _gpu("accelstats_gpu_clock_max_hertz", "Maximum clock frequency by clock domain.",
         _pairs("max_clocks_hz"), ("clock",)),
    _gpu("accelstats_gpu_performance_state", "Performance state (P-state number, 0 = highest).",
         _scalar("performance_state")),
    _gpu("accelstats_gpu_clock_event_active", "1 while the named clock event (throttle) reason is active.",
         _pairs("clock_events"), ("reason",)),
    _gpu("accelstats_gpu_ecc_errors_total", "ECC memory errors by type and counter scope.", _ecc,
         ("type", "scope"), "counter"),
    _gpu("accelstats_gpu_remapped_rows_total", "Remapped memory rows by error type.", _pairs("remapped_rows"),
         ("type",), "counter"),
    _gpu("accelstats_gpu_row_remap_pending", "1 when a row remapping is pending (needs a GPU reset).",
         _flag("row_remap_pending")),
    _gpu("accelstats_gpu_row_remap_failure", "1 when a row remapping failed.", _flag("row_remap_failure")),
    _gpu("accelstats_gpu_pcie_link_generation", "Current PCIe link generation.",
         _scalar("pcie_link_generation")),
    _gpu("accelstats_gpu_pcie_link_width", "Current PCIe link width (lanes).", _scalar("pcie_link_width")),
    _gpu("accelstats_gpu_pcie_replays_total", "PCIe replay counter.", _scalar("pcie_replays"),
         type_="counter"),
    _gpu("accelstats_gpu_pcie_throughput_bytes_per_second",
         "PCIe throughput by direction (rx: host to GPU, tx: GPU to host) over NVML's 20 ms window, "
         "read in the background.", _pairs("pcie_throughput_bytes_per_second"), ("direction",)),
    _gpu("accelstats_gpu_xid_errors_total", "Critical XID errors NVML reported (event set), by XID.",
         _pairs("xid_errors"), ("xid",), "counter"),
    _gpu("accelstats_gpu_critical_xid",
         "The last XID NVML reported for the GPU that makes it unfit for new work until its driver is reset or "
         "reloaded (since the exporter started; 0: none). XIDs an application causes itself (13, 31, 43, 45, "
         "68, 109) are not counted here. Absent where XID events are not watched.", _scalar("xid_critical")),
    _gpu("accelstats_gpu_fan_speed_ratio", "Fan speed as a fraction of its maximum (0-1).",
         _scalar("fan_speed_ratio")),
    _gpu("accelstats_gpu_processes", "Processes on the device by type (compute, graphics, mps).",
         _process_counts, ("type",)),
)

# --- §3 per container ----------------------------------------------------------------------------
CONTAINER_INFO = Family(
    "accelstats_container_info", "gauge",
    "Identity of a container holding an accelerator; value 1.",
    CONTAINER_LABELS + ("runtime", "container_id", "pod_uid", "alloc_id", "task"))
CONTAINER_GPU_LABELS = CONTAINER_LABELS + ("uuid", "gpu", "attribution")
CONTAINER_MEMORY = Family("accelstats_container_gpu_memory_used_bytes", "gauge",
                          "Device memory used by the container's processes (sum of NVML usedGpuMemory).",
                          CONTAINER_GPU_LABELS)
CONTAINER_SM = Family("accelstats_container_gpu_sm_utilization_ratio", "gauge",
                      "SM utilisation of the container's processes since the previous collection (0-1).",
                      CONTAINER_GPU_LABELS)
CONTAINER_PROCESSES = Family("accelstats_container_gpu_processes", "gauge",
                             "The container's processes on the device.", CONTAINER_GPU_LABELS)
CONTAINER_DEVICE_OPEN = Family(
    "accelstats_container_gpu_device_open", "gauge",
    "1 when a process of the container holds the device's /dev/nvidia<minor> open (NVML users such as "
    "monitoring agents do without running on it), 0 when none does.", CONTAINER_GPU_LABELS)
CONTAINER = (CONTAINER_INFO, CONTAINER_MEMORY, CONTAINER_SM, CONTAINER_PROCESSES, CONTAINER_DEVICE_OPEN)

# --- §4 file devices and the exporter itself -------------------------------------------------------
FILE_INFO = Family("accelstats_file_device_info", "gauge", "A file device (Nomad example-plugin model); value 1.",
                   FILE_LABELS)
FILE_HEALTHY = Family("accelstats_file_device_healthy", "gauge",
                      "1 unless the file's permissions equal the configured unhealthy permissions.", FILE_LABELS)
FILE_SIZE = Family("accelstats_file_device_size_bytes", "gauge", "Size of the file device.", FILE_LABELS)
FILE_MTIME = Family("accelstats_file_device_modified_timestamp_seconds", "gauge",
                    "Modification time of the file device (Unix time).", FILE_LABELS)
FILE_MODE = Family("accelstats_file_device_mode", "gauge", "Permission bits of the file device (st_mode & 07777).",
                   FILE_LABELS)
FILES_SKIPPED = Family("accelstats_file_devices_skipped_total", "counter",
                       "Entries of the file-devices directory skipped because their names are not UTF-8.", ())
FILES = (FILE_INFO, FILE_HEALTHY, FILE_SIZE, FILE_MTIME, FILE_MODE, FILES_SKIPPED)

MPS_UP = Family("accelstats_mps_daemon_up", "gauge",
                 "1 when the MPS control daemon answered a health command within its timeout.", ("resource",))
MPS_THREADS = Family("accelstats_mps_active_thread_ratio", "gauge",
                     "Default active thread percentage of the MPS daemon, as a ratio (0-1).", ("resource",))
MPS_PINNED = Family("accelstats_mps_pinned_memory_limit_bytes", "gauge",
                    "Default pinned device memory limit per GPU of the MPS daemon.", ("resource", "uuid"))
MPS_SERVERS = Family("accelstats_mps_servers", "gauge", "MPS servers of the control daemon.", ("resource",))
MPS_CLIENTS = Family("accelstats_mps_clients", "gauge", "MPS clients of the control daemon's servers.",
                     ("resource",))
MPS = (MPS_UP, MPS_THREADS, MPS_PINNED, MPS_SERVERS, MPS_CLIENTS)

BUILD_INFO = Family("accelstats_build_info", "gauge", "accelstats build and NVML versions; value 1.",
                    ("version", "python_version", "nvml_version", "driver_version"))
NVML_STATE = Family(
    "accelstats_nvml_state", "gauge",
    "The nvidia collector's state, value 1: ready (NVML answers), no_device (this host has no NVIDIA PCI "
    "device: nothing to read, not a failure) or unavailable (NVIDIA devices, but NVML does not work: driver "
    "not loaded, library missing, nvmlInit failing, or not answering); reason says why.", ("state", "reason"))
COLLECTOR_SUCCESS = Family("accelstats_scrape_collector_success", "gauge",
                           "1 when the collector succeeded in this collection.", ("collector",))
COLLECTOR_DURATION = Family("accelstats_scrape_collector_duration_seconds", "gauge",
                            "How long the collector took in this collection.", ("collector",))
SKIPPED_LINES = Family("accelstats_devices_list_skipped_lines_total", "counter",
                       "Malformed devices.list lines seen and skipped.", ())
ATTRIBUTION_SKIPPED = Family(
    "accelstats_attribution_skipped_total", "counter",
    "Items skipped during attribution because they vanished or could not be read, by reason.", ("reason",))
NVML_ERRORS = Family("accelstats_nvml_errors_total", "counter",
                     "NVML calls that failed, by call and NVML error (NOT_SUPPORTED excluded).", ("call", "error"))
COLLECTOR_LAST_SUCCESS = Family(
    "accelstats_scrape_collector_last_success_timestamp_seconds", "gauge",
    "Unix time of the last collection in which the collector succeeded; the families it feeds are as of then "
    "when it fails or runs past the collection deadline.", ("collector",))
HTTP_REFUSED = Family(
    "accelstats_http_connections_refused_total", "counter",
    "HTTP connections the server closed without serving them, by reason (connection limit, header or TLS "
    "handshake deadline, idle keep-alive).", ("reason",))
HTTP_REQUESTS = Family(
    "accelstats_http_requests_total", "counter",
    "HTTP requests answered, by status code (every answer the server wrote, errors included).", ("code",))
WEB_CONFIG_RELOAD_FAILURES = Family(
    "accelstats_web_config_reload_failures_total", "counter",
    "Changes of the web configuration file (or its certificate or key) that were refused: the last good "
    "configuration stays in force.", ())
EXPORTER = (BUILD_INFO, COLLECTOR_SUCCESS, COLLECTOR_DURATION, COLLECTOR_LAST_SUCCESS, SKIPPED_LINES,
            ATTRIBUTION_SKIPPED, NVML_ERRORS, NVML_STATE, HTTP_REFUSED, HTTP_REQUESTS, WEB_CONFIG_RELOAD_FAILURES)

ALL: tuple[Family, ...] = (*CADVISOR, GPU_INFO, GPU_UP, GPU_LAST_SUCCESS, *GPU_SAMPLED, *CONTAINER, *FILES, *MPS,
                           *EXPORTER)
