"""The catalog: every metric family accelstats publishes, declared once (the metrics contract).

Each :class:`Family` is one row: the exposition name, type, unit, HELP text, label names, and how to
read its samples from a :class:`accelstats.manager.Collection` (``read``: label values and value per
sample). The ``/metrics`` renderers (:mod:`accelstats.web.exposition`: prometheus_client's families and
the fast encoder) only walk this table; the Nomad plugin's Stats
come from :data:`NOMAD_STATS` below. ``tests/core/test_catalog.py`` checks it against the metrics contract.
Absent values (``None``) produce no sample ("absent, never 0"). Families of the HTTP server
(:data:`SERVER`) have no ``read``: the server's own collector fills them.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from accelstats import __version__
from accelstats.attribution.labels import identity_labels, utf8, utf8_all
from collectors.model import Device, DeviceSample, FileDevice, MpsDaemonReading

if TYPE_CHECKING:
    from accelstats.accounting import Published
    from accelstats.attribution.containers import AcceleratorStats, ContainerStats
    from accelstats.manager import Collection

    _Pair = tuple[AcceleratorStats, tuple[str, ...], tuple[str, ...]]

FamilyType = Literal["gauge", "counter"]
Reading = tuple[tuple[str, ...], float]  # (label values, value)
SampleReader = Callable[[DeviceSample], Iterable[Reading]]  # per device: extra label values and value
Reader = Callable[["Collection"], Iterable[Reading]]  # per collection: all label values and value

#: Base units a family name may end with (OpenMetrics ``# UNIT``), longest first.
UNITS = ("bytes_per_second", "seconds", "bytes", "ratio", "watts", "joules", "celsius", "hertz")


@dataclass(frozen=True)
class Family:
    """One metric family: ``name`` as exposed (counters end in ``_total``), type, HELP, labels, and
    ``read`` (its samples from one collection; None for the HTTP server's families)."""

    name: str
    type: FamilyType
    help: str
    labels: tuple[str, ...]
    read: Reader | None = None

    @property
    def unit(self) -> str:
        """The base unit the name ends with (without ``_total``), or ""."""
        stem = self.name.removesuffix("_total")
        return next((u for u in UNITS if stem.endswith("_" + u)), "")


CADVISOR_LABELS = ("id", "name", "image", "container", "pod", "namespace", "make", "model", "acc_id")
CONTAINER_LABELS = ("id", "name", "image", "container", "pod", "namespace")
GPU_LABELS = ("uuid", "gpu", "model")
FILE_LABELS = ("device", "vendor", "type", "name", "path")
GPU_INFO_LABELS = GPU_LABELS + (
    "minor", "pci_bus_id", "kind", "parent_uuid", "mig_profile", "gpu_instance_id", "compute_instance_id",
    "driver_version", "cuda_driver_version", "vbios_version", "mig_mode", "compute_mode", "persistence_mode",
    "compute_capability", "architecture", "source",
)


def _scalar(attr: str, scale: float = 1.0) -> SampleReader:
    def read(sample: DeviceSample) -> Iterable[Reading]:
        value = getattr(sample, attr)
        if value is not None:
            yield (), float(value) * scale
    return read


def _pairs(attr: str, scale: float = 1.0) -> SampleReader:
    def read(sample: DeviceSample) -> Iterable[Reading]:
        for key, value in getattr(sample, attr):
            yield (str(key),), float(value) * scale
    return read


def _ecc(sample: DeviceSample) -> Iterable[Reading]:
    for etype, scope, count in sample.ecc_errors:
        yield (etype, scope), float(count)


def _flag(attr: str) -> SampleReader:
    def read(sample: DeviceSample) -> Iterable[Reading]:
        value = getattr(sample, attr)
        if value is not None:
            yield (), 1.0 if value else 0.0
    return read


def _process_counts(sample: DeviceSample) -> Iterable[Reading]:
    for ptype in sample.process_types:  # only the lists NVML answered: NOT_SUPPORTED stays absent
        yield (ptype,), float(sum(1 for p in sample.processes or () if ptype in (p.types or (p.type,))))


def _gpu_base(d: Device) -> tuple[str, ...]:
    return (d.uuid, str(d.index), d.name)


def _up_devices(c: Collection) -> Iterator[tuple[Device, DeviceSample]]:
    snap = c.snapshot
    for d in snap.devices:
        sample = snap.samples.get(d.uuid)
        if sample is not None and sample.up:
            yield d, sample


def _gpu_energy_counter(c: Collection) -> Iterator[Reading]:
    # with accounting on, only the split's reading: falling back to the collector's (fresher) one until the
    # split has one would make the counter step back at the next scrape, a reset to Prometheus
    read = dict(c.accounting.energy_read) if c.accounting is not None else None
    for d, sample in _up_devices(c):
        joules = read.get(d.uuid) if read is not None else sample.energy_joules
        if joules is not None:
            yield _gpu_base(d), joules


def _gpu(name: str, help_: str, read: SampleReader, extra: tuple[str, ...] = (),
         type_: FamilyType = "gauge") -> Family:
    """A per-device family: ``read`` on the sample of every device that answered NVML."""
    def collect(c: Collection) -> Iterator[Reading]:
        for d, sample in _up_devices(c):
            base = _gpu_base(d)
            for labels, value in read(sample):
                yield base + labels, value
    return Family(name, type_, help_, GPU_LABELS + extra, collect)


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


def _gpu_info(c: Collection) -> Iterator[Reading]:
    snap = c.snapshot
    for d in snap.devices:
        yield _gpu_base(d) + (
            _opt(d.minor), d.pci_bus_id, d.kind, d.parent_uuid, d.mig_profile, _opt(d.gpu_instance_id),
            _opt(d.compute_instance_id), snap.driver_version, snap.cuda_driver_version, d.vbios_version,
            d.mig_mode, d.compute_mode, d.persistence_mode, d.compute_capability, d.architecture, snap.source), 1.0


def _gpu_up(c: Collection) -> Iterator[Reading]:
    for d in c.snapshot.devices:
        sample = c.snapshot.samples.get(d.uuid)
        yield _gpu_base(d), 1.0 if sample is not None and sample.up else 0.0


def _gpu_last_success(c: Collection) -> Iterator[Reading]:
    for d in c.snapshot.devices:
        if d.uuid in c.snapshot.last_success:
            yield _gpu_base(d), c.snapshot.last_success[d.uuid]


_last_holders: tuple[Collection, list[tuple[ContainerStats, tuple[str, ...]]]] | None = None


def _holders(c: Collection) -> list[tuple[ContainerStats, tuple[str, ...]]]:
    """Containers holding a device, with their identity labels (only those appear in /metrics);
    computed once per collection for the nine container families (the last one is kept, with a
    reference to it, so its ``id`` cannot be reused while cached)."""
    global _last_holders
    last = _last_holders
    if last is not None and last[0] is c:
        return last[1]
    holders = [(container, identity_labels(container)) for container in c.containers if container.accelerators]
    _last_holders = (c, holders)
    return holders


_NO_IDENTITY = ("unknown", "", "", "", "", "")


def _container_info(c: Collection) -> Iterator[Reading]:
    for container, ident in _holders(c):
        i = container.identity
        info = (i.runtime, i.id, i.pod_uid, i.alloc_id, i.task, i.owner) if i is not None else _NO_IDENTITY
        yield ident + utf8_all(info), 1.0


_last_pairs: tuple[Collection, list[_Pair]] | None = None


def _device_pairs(c: Collection) -> list[_Pair]:
    """Each (container, device) pair of :func:`_holders` as (its stats, cAdvisor's labels: identity, make,
    model, acc_id; accelstats' labels: identity, uuid, gpu, attribution): made once per collection for the
    container families (kept like :func:`_holders`), so that each family's samples share one tuple."""
    global _last_pairs
    last = _last_pairs
    if last is not None and last[0] is c:
        return last[1]
    index = {d.uuid: d.index for d in c.snapshot.devices}
    pairs = [(a, ident + (a.make, a.model, a.id), ident + (a.id, str(index.get(a.id, a.index)), a.attribution))
             for container, ident in _holders(c) for a in container.accelerators]
    _last_pairs = (c, pairs)
    return pairs


def _per_accelerator(value: Callable[[AcceleratorStats], float | int | bool | None], cadvisor: bool) -> Reader:
    """A container family: ``value`` of each (container, device) pair, None for none; labels cAdvisor's
    (identity, make, model, acc_id) or accelstats' (identity, uuid, gpu, attribution)."""
    def collect(c: Collection) -> Iterator[Reading]:
        for a, cadvisor_labels, labels in _device_pairs(c):
            v = value(a)
            if v is not None:
                yield (cadvisor_labels if cadvisor else labels), float(v)
    return collect


# --- §1 cAdvisor-compatible (exact names, HELP and labels) ---------------------------------------
CADVISOR_MEMORY_TOTAL = Family("container_accelerator_memory_total_bytes", "gauge",
                               "Total accelerator memory.", CADVISOR_LABELS,
                               _per_accelerator(lambda a: a.memory_total_bytes, cadvisor=True))
CADVISOR_MEMORY_USED = Family("container_accelerator_memory_used_bytes", "gauge",
                              "Total accelerator memory allocated.", CADVISOR_LABELS,
                              _per_accelerator(lambda a: a.memory_used_bytes, cadvisor=True))
CADVISOR_DUTY_CYCLE = Family(
    "container_accelerator_duty_cycle", "gauge",
    "Percent of time over the past sample period during which the accelerator was actively processing.",
    CADVISOR_LABELS, _per_accelerator(lambda a: a.duty_cycle, cadvisor=True))
CADVISOR = (CADVISOR_MEMORY_TOTAL, CADVISOR_MEMORY_USED, CADVISOR_DUTY_CYCLE)

# --- §2 per device --------------------------------------------------------------------------------
GPU_INFO = Family("accelstats_gpu_info", "gauge",
                  "Identity of an NVIDIA GPU or MIG instance (NVML); value 1.", GPU_INFO_LABELS, _gpu_info)
GPU_UP = Family("accelstats_gpu_up", "gauge",
                "1 when the device answered NVML in this collection, 0 when lost or past the deadline.",
                GPU_LABELS, _gpu_up)
GPU_LAST_SUCCESS = Family(
    "accelstats_gpu_last_success_timestamp_seconds", "gauge",
    "Unix time of the last collection that read the device through NVML; a reading older than the scrape "
    "interval is being served from an earlier collection (the device hangs, or NVML is down).", GPU_LABELS,
    _gpu_last_success)
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
    Family("accelstats_gpu_energy_joules_total", "counter",
           "Energy consumed since the driver was loaded (nvmlDeviceGetTotalEnergyConsumption); while the "
           "per-container energy split runs, the reading it last split, so that the containers', idle and "
           "unattributed energy add up to its growth on every scrape.", GPU_LABELS, _gpu_energy_counter),
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
    _gpu("accelstats_gpu_processes", "Processes in each of NVML's process lists of the device (type: compute, "
         "graphics, mps); a process in two lists (a C+G process, an MPS client) counts in both, so the types "
         "do not add up to the processes.",
         _process_counts, ("type",)),
)

# --- §2a GPM profiling and NVLink, read in the background (collectors/profiling.py, collectors/nvlink.py) ---


def _profile(key: str) -> SampleReader:
    def read(sample: DeviceSample) -> Iterable[Reading]:
        for k, label, value in sample.profiling:
            if k == key:
                yield ((label,) if label else ()), value
    return read


def _nvlink_up(sample: DeviceSample) -> Iterable[Reading]:
    for link in sample.nvlinks:
        if link.up is not None:
            yield (str(link.link),), 1.0 if link.up else 0.0


def _nvlink_pairs(attr: str) -> SampleReader:
    def read(sample: DeviceSample) -> Iterable[Reading]:
        for link in sample.nvlinks:
            for key, n in getattr(link, attr):
                yield (str(link.link), key), float(n)
    return read


def _profiling_state(sample: DeviceSample) -> Iterable[Reading]:
    state, reason = sample.profiling_state
    if state:
        yield (state, reason), 1.0


_GPM = "over the last profiling interval (NVML GPM, nvmlGpmMetricsGet; percent/100)"
PROFILING: tuple[Family, ...] = (
    _gpu("accelstats_gpu_sm_active_ratio", f"Fraction of SMs busy (at least one warp resident) {_GPM}.",
         _profile("sm_active")),
    _gpu("accelstats_gpu_sm_occupancy_ratio", f"Resident warps as a fraction of the SMs' maximum {_GPM}.",
         _profile("sm_occupancy")),
    _gpu("accelstats_gpu_graphics_engine_active_ratio",
         f"Fraction of time the graphics or compute engine was active {_GPM}.", _profile("graphics_engine_active")),
    _gpu("accelstats_gpu_tensor_active_ratio",
         f"Fraction of time the SMs' tensor pipes were busy, by pipe (any, hmma, imma, dfma, dmma) {_GPM}.",
         _profile("tensor_active"), ("pipe",)),
    _gpu("accelstats_gpu_dram_active_ratio", f"Fraction of the peak DRAM bandwidth used {_GPM}.",
         _profile("dram_active")),
    _gpu("accelstats_gpu_pipe_active_ratio",
         f"Fraction of time the SMs did non-tensor math, by pipe (fp64, fp32, fp16, integer) {_GPM}.",
         _profile("pipe_active"), ("pipe",)),
    _gpu("accelstats_gpu_nvdec_active_ratio", f"Utilisation of each NVDEC video decoder engine {_GPM}.",
         _profile("nvdec_active"), ("engine",)),
    _gpu("accelstats_gpu_nvjpg_active_ratio", f"Utilisation of each NVJPG JPEG decoder engine {_GPM}.",
         _profile("nvjpg_active"), ("engine",)),
    _gpu("accelstats_gpu_profiling_state",
         "The GPU's or MIG instance's GPM profiling state, value 1: ready (metrics published), waiting (no two "
         "samples yet, or the last sample failed) or unsupported (no GPM: a GPU before Hopper, a driver before "
         "R525); reason says why.", _profiling_state, ("state", "reason")),
    _gpu("accelstats_gpu_nvlink_up", "1 while the NVLink link is active, 0 when down (nvmlDeviceGetNvLinkState).",
         _nvlink_up, ("link",)),
    _gpu("accelstats_gpu_nvlink_data_bytes_total",
         "NVLink payload bytes by link and direction (tx: sent, rx: received; NVML's THROUGHPUT_DATA "
         "field values, KiB x 1024).", _nvlink_pairs("data_bytes"), ("link", "direction"), "counter"),
    _gpu("accelstats_gpu_nvlink_errors_total",
         "NVLink data-link errors by link and type (crc_flit, replay, recovery; nvmlDeviceGetNvLinkErrorCounter).",
         _nvlink_pairs("errors"), ("link", "type"), "counter"),
)

# --- Nomad device plugin Stats (one StatObject attribute per row; accelstats/nomad/devices.py) -------
MIB = 1 << 20
Ratio = tuple[float | int | None, float | int | None]  # (numerator, denominator); numerator None: "N/A"


@dataclass(frozen=True)
class NomadStat:
    """One attribute of a GPU's Stats message, named and described as HashiCorp's NVIDIA plugin does
    (nomad-device-nvidia ``stats.go``); ``read`` gives (numerator, denominator) from a sample in the
    stat's ``unit`` (a None numerator is sent as ``"N/A"``)."""

    name: str
    unit: str
    desc: str
    read: Callable[[DeviceSample], Ratio]


def _mib(value: int | None) -> int | None:
    return None if value is None else value // MIB


def _pct(ratio: float | None) -> int | None:
    return None if ratio is None else round(ratio * 100)


def _memory_state(s: DeviceSample) -> Ratio:
    used = _mib(s.memory_used_bytes)
    return used, _mib(s.memory_total_bytes) if used is not None else None


def _corrected_volatile(s: DeviceSample) -> Ratio:
    counts = [n for kind, scope, n in s.ecc_errors if scope == "volatile" and kind == "corrected"]
    return (sum(counts) if counts else None), None


def _power(s: DeviceSample) -> Ratio:
    if s.power_watts is None:
        return None, None
    return round(s.power_watts, 1), None if s.power_limit_watts is None else round(s.power_limit_watts, 1)


NOMAD_STATS: tuple[NomadStat, ...] = (
    NomadStat("GPU utilization", "%", "GPU utilization", lambda s: (_pct(s.utilization_ratio), None)),
    NomadStat("Memory utilization", "%", "Memory utilization", lambda s: (_pct(s.memory_utilization_ratio), None)),
    NomadStat("Encoder utilization", "%", "Encoder utilization", lambda s: (_pct(s.encoder_utilization_ratio), None)),
    NomadStat("Decoder utilization", "%", "Decoder utilization", lambda s: (_pct(s.decoder_utilization_ratio), None)),
    NomadStat("Temperature", "C", "Temperature",
              lambda s: (int(dict(s.temperatures_celsius)["gpu"]) if "gpu" in dict(s.temperatures_celsius)
                         else None, None)),
    NomadStat("Memory state", "MiB", "UsedMemory / TotalMemory", _memory_state),
    NomadStat("BAR1 buffer state", "MiB", "UsedBAR1 / TotalBAR1",
              lambda s: (_mib(s.bar1_used_bytes), _mib(s.bar1_total_bytes) if s.bar1_used_bytes is not None else None)),
    # nomad-device-nvidia reads corrected volatile counts per location (L1, L2, device memory); accelstats
    # reads the total over all locations (nvmlDeviceGetTotalEccErrors), so L1 and L2 are N/A.
    NomadStat("ECC L1 errors", "#", "ECC L1 errors", lambda s: (None, None)),
    NomadStat("ECC L2 errors", "#", "ECC L2 errors", lambda s: (None, None)),
    NomadStat("ECC memory errors", "#", "ECC memory errors (corrected, volatile, all locations)", _corrected_volatile),
    # watts: HashiCorp's plugin sends milliwatts labelled W
    NomadStat("Power usage", "W", "Power usage / Power limit", _power),
)
NOMAD_SUMMARY = next(stat for stat in NOMAD_STATS if stat.name == "Memory state")  # `nomad node status` shows it

# --- §3 per container ----------------------------------------------------------------------------
CONTAINER_INFO = Family(
    "accelstats_container_info", "gauge",
    "Identity of a container holding an accelerator; value 1.",
    CONTAINER_LABELS + ("runtime", "container_id", "pod_uid", "alloc_id", "task", "owner_uid"), _container_info)
CONTAINER_GPU_LABELS = CONTAINER_LABELS + ("uuid", "gpu", "attribution")
CONTAINER_MEMORY = Family("accelstats_container_gpu_memory_used_bytes", "gauge",
                          "Device memory used by the container's processes (sum of NVML usedGpuMemory).",
                          CONTAINER_GPU_LABELS, _per_accelerator(lambda a: a.container_memory_used_bytes, False))
CONTAINER_SM = Family("accelstats_container_gpu_sm_utilization_ratio", "gauge",
                      "SM utilisation of the container's processes since the previous collection (0-1).",
                      CONTAINER_GPU_LABELS, _per_accelerator(lambda a: a.container_sm_utilization_ratio, False))
CONTAINER_PROCESSES = Family("accelstats_container_gpu_processes", "gauge",
                             "The container's processes on the device.", CONTAINER_GPU_LABELS,
                             _per_accelerator(lambda a: a.container_processes, False))
CONTAINER_DEVICE_OPEN = Family(
    "accelstats_container_gpu_device_open", "gauge",
    "1 when a process of the container holds the device's /dev/nvidia<minor> open (NVML users such as "
    "monitoring agents do without running on it), 0 when none does.", CONTAINER_GPU_LABELS,
    _per_accelerator(lambda a: a.device_open, False))


def _unallocated(c: Collection) -> Iterator[Reading]:
    from accelstats.attribution.kubelet_evidence import unallocated

    index = {d.uuid: d.index for d in c.snapshot.devices}
    for container, a in unallocated(c.containers, c.snapshot.kubelet):
        yield identity_labels(container) + (a.id, str(index.get(a.id, a.index)), a.attribution), 1.0


CONTAINER_UNALLOCATED = Family(
    "accelstats_container_gpu_unallocated", "gauge",
    "1 for a device the container uses (attribution devices_cgroup, process or open_fd) that the kubelet's "
    "pod-resources List allocated to no container of its namespace, pod and name; only while the kubelet "
    "answers.", CONTAINER_GPU_LABELS, _unallocated)
CONTAINER = (CONTAINER_INFO, CONTAINER_MEMORY, CONTAINER_SM, CONTAINER_PROCESSES, CONTAINER_DEVICE_OPEN,
             CONTAINER_UNALLOCATED)

# --- §3b Kubernetes: the kubelet's pod-resources allocations (accelstats/kubernetes/collector.py) ----
KUBERNETES_ALLOCATION_LABELS = ("namespace", "pod", "container", "resource", "uuid", "gpu", "replica")
KUBERNETES_CLAIM_LABELS = ("namespace", "pod", "container", "claim", "claim_namespace", "driver", "pool", "device",
                           "uuid", "gpu")


def _kubelet_allocations(claims: bool) -> Reader:
    def collect(c: Collection) -> Iterator[Reading]:
        k = c.snapshot.kubelet
        if k is None or not k.up:
            return
        seen: set[tuple[str, ...]] = set()
        for a in k.allocations:
            if bool(a.claim) != claims:
                continue
            labels = ((a.namespace, a.pod, a.container, a.claim, a.claim_namespace, a.driver, a.pool, a.device,
                       a.uuid, a.gpu) if claims else
                      (a.namespace, a.pod, a.container, a.resource, a.uuid, a.gpu, a.replica))
            if labels not in seen:  # the same ID twice in one container is one allocation
                seen.add(labels)
                yield tuple(utf8(v) for v in labels), 1.0
    return collect


KUBERNETES_ALLOCATION = Family(
    "accelstats_kubernetes_gpu_allocation", "gauge",
    "A GPU or MIG instance the kubelet's device plugins allocated to a container (pod-resources List); value 1. "
    "replica: the sharing replica of a time-sliced or MPS device ('' when not shared).",
    KUBERNETES_ALLOCATION_LABELS, _kubelet_allocations(claims=False))
KUBERNETES_CLAIM_ALLOCATION = Family(
    "accelstats_kubernetes_gpu_claim_allocation", "gauge",
    "A device of a DRA resource claim the kubelet reports a container uses (pod-resources List); value 1. "
    "uuid and gpu are '' while the claimed device is not resolved to a GPU of this host.",
    KUBERNETES_CLAIM_LABELS, _kubelet_allocations(claims=True))
POD_RESOURCES_UP = Family(
    "accelstats_kubernetes_pod_resources_up", "gauge",
    "1 when the kubelet's pod-resources List answered in this collection, 0 when it failed; absent without a "
    "pod-resources socket.", (),
    lambda c: [((), 1.0 if c.snapshot.kubelet.up else 0.0)] if c.snapshot.kubelet is not None else [])
POD_RESOURCES_ERRORS = Family(
    "accelstats_kubernetes_pod_resources_errors_total", "counter",
    "Failed pod-resources List calls, by reason (deadline, too_large, unavailable, not_a_socket, garbage, error).",
    ("reason",),
    lambda c: [((reason,), float(n)) for reason, n in c.snapshot.kubelet.errors] if c.snapshot.kubelet else [])
KUBERNETES = (KUBERNETES_ALLOCATION, KUBERNETES_CLAIM_ALLOCATION, POD_RESOURCES_UP, POD_RESOURCES_ERRORS)


def _sole_holder(key: str) -> Reader:
    """A device's GPM ``key`` metric on the series of the one container holding it (a whole GPU or a
    MIG instance); nothing where several containers hold the device: GPM measures the GPU or GPU
    instance, not processes, so a shared device's activity cannot be split among them."""
    def collect(c: Collection) -> Iterator[Reading]:
        if not any(s.profiling for s in c.snapshot.samples.values()):
            return  # no GPM readings this collection (off, unsupported, not yet sampled): no container pass
        pairs = _device_pairs(c)
        count: dict[str, int] = {}
        for a, _, _ in pairs:
            count[a.id] = count.get(a.id, 0) + 1
        for a, _, base in pairs:
            sample = c.snapshot.samples.get(a.id)
            if count[a.id] != 1 or sample is None or not sample.up:
                continue
            for k, label, value in sample.profiling:
                if k == key:
                    yield base + ((label,) if label else ()), value
    return collect


_SOLE = ("of the device the container alone holds (a whole GPU or a MIG instance; absent where containers "
         "share it: GPM measures the device, not processes)")
CONTAINER_PROFILING = (
    Family("accelstats_container_gpu_sm_active_ratio", "gauge", f"GPM SM activity {_SOLE}.",
           CONTAINER_GPU_LABELS, _sole_holder("sm_active")),
    Family("accelstats_container_gpu_sm_occupancy_ratio", "gauge", f"GPM SM occupancy {_SOLE}.",
           CONTAINER_GPU_LABELS, _sole_holder("sm_occupancy")),
    Family("accelstats_container_gpu_tensor_active_ratio", "gauge", f"GPM tensor pipe activity by pipe {_SOLE}.",
           CONTAINER_GPU_LABELS + ("pipe",), _sole_holder("tensor_active")),
    Family("accelstats_container_gpu_dram_active_ratio", "gauge", f"GPM DRAM bandwidth use {_SOLE}.",
           CONTAINER_GPU_LABELS, _sole_holder("dram_active")),
)

# --- §3a GPU accounting: counters integrated by the background sampler (accelstats/accounting/) ------
ACCOUNTING_LABELS = CONTAINER_LABELS + ("uuid", "gpu")  # no attribution label: it may change mid-life


def _accounts(value: Callable[[Published], float | None]) -> Reader:
    """An accounting family: ``value`` of each (container, device), None for none."""
    def collect(c: Collection) -> Iterator[Reading]:
        if c.accounting is not None:
            for a in c.accounting.accounts:
                v = value(a)
                if v is not None:
                    yield a.labels, v
    return collect


def _gpu_energy(which: int) -> Reader:
    def collect(c: Collection) -> Iterator[Reading]:
        if c.accounting is not None:
            gpus = {d.uuid: d for d in c.snapshot.devices}
            for uuid, *joules in c.accounting.devices:
                d = gpus.get(uuid)
                if d is not None:
                    yield (uuid, str(d.index), d.name), joules[which]
    return collect


def _allocated(a: Published) -> float | None:
    return a.allocated_seconds if a.was_allocated else None


def _idle(a: Published) -> float | None:
    return a.idle_seconds if a.was_allocated and a.has_sm else None


ACCOUNT_SM = Family(
    "accelstats_container_gpu_sm_seconds_total", "counter",
    "SM-busy seconds of the container's processes on the device: every NVML per-process utilisation sample "
    "integrated once over the time it covers.", ACCOUNTING_LABELS,
    _accounts(lambda a: a.sm_seconds if a.has_sm else None))
ACCOUNT_MEMORY = Family(
    "accelstats_container_gpu_memory_byte_seconds_total", "counter",
    "Device memory used by the container's processes (NVML usedGpuMemory) integrated over time.", ACCOUNTING_LABELS,
    _accounts(lambda a: a.memory_byte_seconds))
ACCOUNT_ENERGY = Family(
    "accelstats_container_gpu_energy_joules_total", "counter",
    "The container's share of the GPU's energy: each energy counter delta split by SM-busy seconds.",
    ACCOUNTING_LABELS, _accounts(lambda a: a.energy_joules if a.has_sm else None))
ACCOUNT_ALLOCATED = Family(
    "accelstats_container_gpu_allocated_seconds_total", "counter",
    "Seconds the container's devices cgroup granted it the device.", ACCOUNTING_LABELS, _accounts(_allocated))
ACCOUNT_IDLE = Family(
    "accelstats_container_gpu_idle_seconds_total", "counter",
    "Allocated seconds in which none of the container's processes was SM-busy on the device.", ACCOUNTING_LABELS,
    _accounts(_idle))
GPU_IDLE_ENERGY = Family(
    "accelstats_gpu_idle_energy_joules_total", "counter",
    "Energy the GPU used while no process was SM-busy on it (the part of each delta no process's share took).",
    GPU_LABELS, _gpu_energy(0))
GPU_UNATTRIBUTED_ENERGY = Family(
    "accelstats_gpu_unattributed_energy_joules_total", "counter",
    "Energy shares of SM-busy processes outside containers or whose cgroup could not be read, and all energy "
    "of windows in which the GPU gave no per-process utilisation (MIG mode, a failed read).", GPU_LABELS,
    _gpu_energy(1))
ACCOUNTING_DISCARDED = Family(
    "accelstats_accounting_discarded_total", "counter",
    "Accounting readings left out or not attributed, by reason: energy_jump (an energy delta above 10 kW), "
    "sample_from_future (a sample stamped after the wall clock), clock_stepped_back (reads restarted), "
    "cgroup_unknown (a process whose /proc/<pid>/cgroup could not be read: its energy goes unattributed), "
    "ledger_full (over 10000 ended containers waiting for a scrape), accounts_full (over 4096 container-GPU "
    "accounts: the longest-idle one's series ended early, or, none idle, a new one's readings not attributed).",
    ("reason",),
    lambda c: [((reason,), float(n)) for reason, n in c.accounting.discarded] if c.accounting is not None else [])
ACCOUNTING = (ACCOUNT_SM, ACCOUNT_MEMORY, ACCOUNT_ENERGY, ACCOUNT_ALLOCATED, ACCOUNT_IDLE, GPU_IDLE_ENERGY,
              GPU_UNATTRIBUTED_ENERGY, ACCOUNTING_DISCARDED)

# --- §4 file devices and the exporter itself -------------------------------------------------------


def _files(value: Callable[[FileDevice], float]) -> Reader:
    def collect(c: Collection) -> Iterator[Reading]:
        for f in c.snapshot.file_devices:
            yield (f.id, f.vendor, f.type, f.name, utf8(f.path)), value(f)
    return collect


def _files_skipped(c: Collection) -> Iterator[Reading]:
    if any(r.name == "files" for r in c.snapshot.collector_results):
        yield (), float(c.snapshot.file_devices_skipped_total)


FILE_INFO = Family("accelstats_file_device_info", "gauge", "A file device (Nomad example-plugin model); value 1.",
                   FILE_LABELS, _files(lambda f: 1.0))
FILE_HEALTHY = Family("accelstats_file_device_healthy", "gauge",
                      "1 unless the file's permissions equal the configured unhealthy permissions.", FILE_LABELS,
                      _files(lambda f: 1.0 if f.healthy else 0.0))
FILE_SIZE = Family("accelstats_file_device_size_bytes", "gauge", "Size of the file device.", FILE_LABELS,
                   _files(lambda f: float(f.size_bytes)))
FILE_MTIME = Family("accelstats_file_device_modified_timestamp_seconds", "gauge",
                    "Modification time of the file device (Unix time).", FILE_LABELS,
                    _files(lambda f: f.modified_timestamp_seconds))
FILE_MODE = Family("accelstats_file_device_mode", "gauge", "Permission bits of the file device (st_mode & 07777).",
                   FILE_LABELS, _files(lambda f: float(f.mode)))
FILES_SKIPPED = Family("accelstats_file_devices_skipped_total", "counter",
                       "Entries of the file-devices directory skipped because their names are not UTF-8.", (),
                       _files_skipped)
FILES = (FILE_INFO, FILE_HEALTHY, FILE_SIZE, FILE_MTIME, FILE_MODE, FILES_SKIPPED)

def _mps(value: Callable[[MpsDaemonReading], float | int | None], when_down: bool = False) -> Reader:
    def collect(c: Collection) -> Iterator[Reading]:
        for m in c.snapshot.mps:
            v = value(m)
            if (m.up or when_down) and v is not None:
                yield (m.resource,), float(v)
    return collect


def _mps_pinned(c: Collection) -> Iterator[Reading]:
    for m in c.snapshot.mps:
        if m.up:
            for uuid, limit in m.pinned_memory_limit_bytes:
                if limit is not None:
                    yield (m.resource, uuid), float(limit)


MPS_UP = Family("accelstats_mps_daemon_up", "gauge",
                "1 when the MPS control daemon answered a health command within its timeout.", ("resource",),
                _mps(lambda m: 1.0 if m.up else 0.0, when_down=True))
MPS_THREADS = Family("accelstats_mps_active_thread_ratio", "gauge",
                     "Default active thread percentage of the MPS daemon, as a ratio (0-1).", ("resource",),
                     _mps(lambda m: m.active_thread_ratio))
MPS_PINNED = Family("accelstats_mps_pinned_memory_limit_bytes", "gauge",
                    "Default pinned device memory limit per GPU of the MPS daemon.", ("resource", "uuid"), _mps_pinned)
MPS_SERVERS = Family("accelstats_mps_servers", "gauge", "MPS servers of the control daemon.", ("resource",),
                     _mps(lambda m: m.servers))
MPS_CLIENTS = Family("accelstats_mps_clients", "gauge", "MPS clients of the control daemon's servers.",
                     ("resource",), _mps(lambda m: m.clients))
MPS = (MPS_UP, MPS_THREADS, MPS_PINNED, MPS_SERVERS, MPS_CLIENTS)

BUILD_INFO = Family("accelstats_build_info", "gauge", "accelstats build and NVML versions; value 1.",
                    ("version", "python_version", "nvml_version", "driver_version"),
                    lambda c: [((__version__, platform.python_version(), c.snapshot.nvml_version,
                                 c.snapshot.driver_version), 1.0)])
NVML_STATE = Family(
    "accelstats_nvml_state", "gauge",
    "The nvidia collector's state, value 1: ready (NVML answers), no_device (this host has no NVIDIA PCI "
    "device: nothing to read, not a failure) or unavailable (NVIDIA devices, but NVML does not work: driver "
    "not loaded, library missing, nvmlInit failing, or not answering); reason says why.", ("state", "reason"),
    lambda c: [((c.snapshot.nvml_state, c.snapshot.nvml_status), 1.0)] if c.snapshot.nvml_state else [])
COLLECTOR_SUCCESS = Family("accelstats_scrape_collector_success", "gauge",
                           "1 when the collector succeeded in this collection.", ("collector",),
                           lambda c: [((r.name,), 1.0 if r.success else 0.0) for r in c.snapshot.collector_results])
COLLECTOR_DURATION = Family("accelstats_scrape_collector_duration_seconds", "gauge",
                            "How long the collector took in this collection.", ("collector",),
                            lambda c: [((r.name,), r.duration_seconds) for r in c.snapshot.collector_results])
SKIPPED_LINES = Family("accelstats_devices_list_skipped_lines_total", "counter",
                       "Malformed devices.list lines seen and skipped.", (),
                       lambda c: [((), float(c.devices_list_skipped_lines_total))])
ATTRIBUTION_SKIPPED = Family(
    "accelstats_attribution_skipped_total", "counter",
    "Items skipped during attribution because they vanished or could not be read, by reason "
    "(runtime_index_refused: a containers/storage index not used: too large, too dense, not a JSON list).",
    ("reason",),
    lambda c: [((reason,), float(n)) for reason, n in sorted(c.attribution_skipped.items())])
NVML_ERRORS = Family("accelstats_nvml_errors_total", "counter",
                     "NVML calls that failed, by call and NVML error (NOT_SUPPORTED excluded).", ("call", "error"),
                     lambda c: [((call, error), float(n)) for (call, error), n in sorted(c.nvml_errors.items())])
COLLECTOR_LAST_SUCCESS = Family(
    "accelstats_scrape_collector_last_success_timestamp_seconds", "gauge",
    "Unix time of the last collection in which the collector succeeded; the families it feeds are as of then "
    "when it fails or runs past the collection deadline.", ("collector",),
    lambda c: [((name,), when) for name, when in sorted(c.collector_last_success.items())])
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
SERVER = (HTTP_REFUSED, HTTP_REQUESTS, WEB_CONFIG_RELOAD_FAILURES)  # read by the HTTP server's collector
EXPORTER = (BUILD_INFO, COLLECTOR_SUCCESS, COLLECTOR_DURATION, COLLECTOR_LAST_SUCCESS, SKIPPED_LINES,
            ATTRIBUTION_SKIPPED, NVML_ERRORS, NVML_STATE, *SERVER)

ALL: tuple[Family, ...] = (*CADVISOR, GPU_INFO, GPU_UP, GPU_LAST_SUCCESS, *GPU_SAMPLED, *PROFILING, *CONTAINER,
                           *CONTAINER_PROFILING, *KUBERNETES, *ACCOUNTING, *FILES, *MPS, *EXPORTER)
#: The families read from a collection, in exposition order (every row but the HTTP server's).
COLLECTED: tuple[Family, ...] = tuple(f for f in ALL if f.read is not None)
