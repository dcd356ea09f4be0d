"""The processes NVML lists on one device: one reading for the collection's pass
(:mod:`collectors.nvidia`) and the accounting sampler (:mod:`collectors.procsampler`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collectors.model import ProcessType
from collectors.nvml_call import NvmlCaller

# MPS first: NVML lists an MPS client in both the MPS and the compute list (docs/mps.md, measured
# on the H200), and the first list naming a PID gives its type; the MPS server is only in the
# compute list. Compute before graphics: a "C+G" process counts as compute.
PROCESS_CALLS: tuple[tuple[ProcessType, str], ...] = (
    ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
    ("compute", "nvmlDeviceGetComputeRunningProcesses"),
    ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
)
NOT_AVAILABLE = (2**64 - 1, 2**32 - 1)  # NVML_VALUE_NOT_AVAILABLE as usedGpuMemory (unsigned long long, int)
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId of a process outside MIG instances


@dataclass(frozen=True)
class Listed:
    """One PID as the process lists give it: ``type`` from the first list naming it, the first known
    ``used_memory_bytes`` among the lists (None: "not available" in all), ``gpu_instance_id``
    (:data:`NO_INSTANCE` outside MIG; absent from NVML's v1 structs, before MIG); ``types``: every list
    naming it (a "C+G" process: compute and graphics)."""

    type: ProcessType
    used_memory_bytes: int | None
    gpu_instance_id: int
    types: tuple[ProcessType, ...] = ()


def used_memory(proc: Any) -> int | None:
    """``usedGpuMemory`` in bytes of an ``nvmlProcessInfo`` struct, None when NVML says "not available"."""
    value = getattr(proc, "usedGpuMemory", None)
    if value is None or value in NOT_AVAILABLE:
        return None
    return int(value)


def running_processes(call: NvmlCaller, handle: Any) -> tuple[dict[int, Listed], tuple[ProcessType, ...]]:
    """The MPS, compute and graphics processes on ``handle`` (``nvmlDevice*RunningProcesses``; the
    ``_v2`` symbol when pynvml's ``_v3`` is missing, before R510), a PID once: ``({pid: Listed}, the types
    whose list answered)``. A PID listed more than once (a "C+G" process, an MPS client) is one process,
    so its memory is counted once. Raises what ``call`` raises (DeviceLostError, NvmlUnavailableError)."""
    found: dict[int, Listed] = {}
    readable: list[ProcessType] = []
    for ptype, name in PROCESS_CALLS:
        procs = call(name, handle)
        if procs is None and call.missing(name):
            procs = call(f"{name}_v2", handle)
        if procs is None:
            continue
        readable.append(ptype)
        for p in procs:
            pid, used = int(p.pid), used_memory(p)
            first = found.get(pid)
            if first is None:
                found[pid] = Listed(ptype, used, int(getattr(p, "gpuInstanceId", NO_INSTANCE)), (ptype,))
                continue
            types = first.types if ptype in first.types else (*first.types, ptype)
            known = used if first.used_memory_bytes is None and used is not None else first.used_memory_bytes
            found[pid] = Listed(first.type, known, first.gpu_instance_id, types)  # a known amount wins
    return found, tuple(readable)
