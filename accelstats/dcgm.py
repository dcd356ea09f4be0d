"""dcgm-exporter's names: the same readings under ``DCGM_FI_*`` names and labels (setting ``dcgm_names``).

Off by default. With it on, every collection also carries the families of :data:`FAMILIES`, so
dashboards and alerts written for NVIDIA's dcgm-exporter (its own ``grafana/dcgm-exporter-dashboard.json``
among them) work unchanged on accelstats. They are renamed copies of readings accelstats already
publishes, in dcgm-exporter's units (docs/profiling.md has the table, with the accelstats family of each):

* labels: ``gpu`` (NVML index), ``UUID`` (the physical GPU's, as dcgm-exporter labels MIG instances),
  ``pci_bus_id``, ``device`` (``nvidia<minor>``), ``modelName``, ``Hostname``, and for a MIG instance
  ``GPU_I_ID`` and ``GPU_I_PROFILE`` (dcgm-exporter's labels for GPU entities);
* units as DCGM's fields: ``DCGM_FI_DEV_*`` in °C, W, MHz, MiB and percent 0-100;
  ``DCGM_FI_PROF_*`` ratios 0-1 (GPM's percent / 100, as accelstats' own families);
* NVLink error counts summed over the GPU's links (DCGM's ``..._ERROR_COUNT_TOTAL`` fields), typed
  gauge so that the exposed name is exactly DCGM's (a counter's name would gain ``_total``).

The families are not in :data:`accelstats.catalog.ALL`: their names keep DCGM's upper case, which the
catalog's naming rules (and Prometheus's conventions) do not allow for accelstats' own.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from accelstats.catalog import Family, Reading
from collectors.model import Device, DeviceSample

if TYPE_CHECKING:
    from accelstats.manager import Collection

LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "GPU_I_ID", "GPU_I_PROFILE")
MIB = 1 << 20
_HOSTNAME = socket.gethostname()


def _labels(d: Device, parents: dict[str, Device]) -> tuple[str, ...]:
    parent = parents.get(d.parent_uuid, d) if d.kind == "mig" else d
    minor = parent.minor
    return (str(d.index), parent.uuid, d.pci_bus_id, "" if minor is None else f"nvidia{minor}", d.name, _HOSTNAME,
            "" if d.gpu_instance_id is None else str(d.gpu_instance_id), d.mig_profile)


def _dcgm(value: Callable[[DeviceSample], float | None]) -> Callable[[Collection], Iterator[Reading]]:
    """A DCGM family's reader: ``value`` of every device that answered, when ``dcgm_names`` is on."""
    def collect(c: Collection) -> Iterator[Reading]:
        if not c.dcgm_names:
            return
        parents = {d.uuid: d for d in c.snapshot.devices if d.kind == "gpu"}
        for d in c.snapshot.devices:
            sample = c.snapshot.samples.get(d.uuid)
            if sample is None or not sample.up:
                continue
            v = value(sample)
            if v is not None:
                yield _labels(d, parents), float(v)
    return collect


def _pair(attr: str, key: str, scale: float = 1.0) -> Callable[[DeviceSample], float | None]:
    def read(s: DeviceSample) -> float | None:
        v = dict(getattr(s, attr)).get(key)
        return None if v is None else float(v) * scale
    return read


def _profile(key: str, label: str = "") -> Callable[[DeviceSample], float | None]:
    def read(s: DeviceSample) -> float | None:
        return next((v for k, lab, v in s.profiling if k == key and lab == label), None)
    return read


def _scaled(attr: str, scale: float) -> Callable[[DeviceSample], float | None]:
    def read(s: DeviceSample) -> float | None:
        v = getattr(s, attr)
        return None if v is None else float(v) * scale
    return read


def _nvlink_errors(kind: str) -> Callable[[DeviceSample], float | None]:
    def read(s: DeviceSample) -> float | None:
        counts = [n for link in s.nvlinks for k, n in link.errors if k == kind]
        return float(sum(counts)) if counts else None
    return read


def _gauge(name: str, help_: str, value: Callable[[DeviceSample], float | None]) -> Family:
    return Family(name, "gauge", help_, LABELS, _dcgm(value))


#: (family, the accelstats family it copies): the mapping docs/profiling.md tabulates.
MAPPING: tuple[tuple[Family, str], ...] = (
    (_gauge("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", _pair("temperatures_celsius", "gpu")),
     'accelstats_gpu_temperature_celsius{sensor="gpu"}'),
    (_gauge("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", _pair("temperatures_celsius", "memory")),
     'accelstats_gpu_temperature_celsius{sensor="memory"}'),
    (_gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", _scaled("power_watts", 1.0)),
     "accelstats_gpu_power_watts"),
    (_gauge("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", _pair("clocks_hz", "sm", 1e-6)),
     'accelstats_gpu_clock_hertz{clock="sm"} / 1e6'),
    (_gauge("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", _pair("clocks_hz", "memory", 1e-6)),
     'accelstats_gpu_clock_hertz{clock="memory"} / 1e6'),
    (_gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", _scaled("utilization_ratio", 100.0)),
     "accelstats_gpu_utilization_ratio * 100"),
    (_gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", _scaled("memory_used_bytes", 1 / MIB)),
     "accelstats_gpu_memory_used_bytes / 2^20"),
    (_gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", _scaled("memory_free_bytes", 1 / MIB)),
     "accelstats_gpu_memory_free_bytes / 2^20"),
    (_gauge("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.",
            _profile("graphics_engine_active")), "accelstats_gpu_graphics_engine_active_ratio"),
    (_gauge("DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp assigned.",
            _profile("sm_active")), "accelstats_gpu_sm_active_ratio"),
    (_gauge("DCGM_FI_PROF_SM_OCCUPANCY", "The ratio of number of warps resident on an SM.",
            _profile("sm_occupancy")), "accelstats_gpu_sm_occupancy_ratio"),
    (_gauge("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor pipes are active.",
            _profile("tensor_active", "any")), 'accelstats_gpu_tensor_active_ratio{pipe="any"}'),
    (_gauge("DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE", "Ratio of cycles the tensor HMMA pipe is active.",
            _profile("tensor_active", "hmma")), 'accelstats_gpu_tensor_active_ratio{pipe="hmma"}'),
    (_gauge("DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE", "Ratio of cycles the tensor IMMA pipe is active.",
            _profile("tensor_active", "imma")), 'accelstats_gpu_tensor_active_ratio{pipe="imma"}'),
    (_gauge("DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE", "Ratio of cycles the tensor DFMA pipe is active.",
            _profile("tensor_active", "dfma")), 'accelstats_gpu_tensor_active_ratio{pipe="dfma"}'),
    (_gauge("DCGM_FI_PROF_DRAM_ACTIVE", "Ratio of cycles the device memory interface is active sending or "
            "receiving data.", _profile("dram_active")), "accelstats_gpu_dram_active_ratio"),
    (_gauge("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "Ratio of cycles the fp64 pipes are active.",
            _profile("pipe_active", "fp64")), 'accelstats_gpu_pipe_active_ratio{pipe="fp64"}'),
    (_gauge("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "Ratio of cycles the fp32 pipes are active.",
            _profile("pipe_active", "fp32")), 'accelstats_gpu_pipe_active_ratio{pipe="fp32"}'),
    (_gauge("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "Ratio of cycles the fp16 pipes are active.",
            _profile("pipe_active", "fp16")), 'accelstats_gpu_pipe_active_ratio{pipe="fp16"}'),
    (_gauge("DCGM_FI_PROF_PIPE_INT_ACTIVE", "Ratio of cycles the integer pipe is active.",
            _profile("pipe_active", "integer")), 'accelstats_gpu_pipe_active_ratio{pipe="integer"}'),
    (_gauge("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "Total number of NVLink flow-control CRC errors.",
            _nvlink_errors("crc_flit")), 'sum without (link) (accelstats_gpu_nvlink_errors_total{type="crc_flit"})'),
    (_gauge("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "Total number of NVLink retries.",
            _nvlink_errors("replay")), 'sum without (link) (accelstats_gpu_nvlink_errors_total{type="replay"})'),
    (_gauge("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "Total number of NVLink recovery errors.",
            _nvlink_errors("recovery")), 'sum without (link) (accelstats_gpu_nvlink_errors_total{type="recovery"})'),
)
FAMILIES: tuple[Family, ...] = tuple(f for f, _ in MAPPING)
"""The dcgm-exporter families, rendered after the catalog's (empty unless ``dcgm_names`` is on)."""
