"""Per-container accelerator stats: cAdvisor's ``AcceleratorCollector`` and what it fills.

A collector is made for one container's devices cgroup by
:meth:`accelstats.manager.AcceleratorManager.get_collector` and bound to one collection's device
snapshot. ``update_stats(stats)`` appends one :class:`AcceleratorStats` per device the container is
attributed, saying how (``attribution``):

* ``devices_cgroup`` — cgroup v1: the container's ``devices.list`` grants ``c 195:<minor> r|w``
  (spec/cgroups.md §2, re-read on every collection so ``docker update`` is seen);
* ``process`` — an unrestricted v1 cgroup (``a *:* rwm``): the devices NVML lists a process of
  this container on (``/proc/<pid>/cgroup``).

Device-wide numbers (memory total/used, duty cycle) stay device-wide, as cAdvisor's were; the
container's own numbers come from NVML's per-process data summed over the processes whose
``/proc/<pid>/cgroup`` names this container's cgroup.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from accelstats.cgroups import (
    ContainerIdentity,
    GpuGrant,
    gpu_grant,
    parse_devices_list,
    parse_proc_cgroup,
    read_devices_list_text,
)
from collectors.model import Device, DeviceSnapshot, ProcessUsage

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195


@dataclass(frozen=True)
class AcceleratorStats:
    """One device as seen from one container (cAdvisor's ``AcceleratorStats`` plus attribution).

    ``memory_*`` are device-wide bytes, ``duty_cycle`` device-wide percent 0-100 (cAdvisor
    compatibility); ``container_memory_used_bytes`` / ``container_sm_utilization_ratio`` /
    ``container_processes`` are the container's own share, ``None`` when NVML's process list is
    not readable.
    """

    make: str
    model: str
    id: str
    minor: int | None
    index: int
    attribution: str
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    duty_cycle: float | None
    container_memory_used_bytes: int | None
    container_sm_utilization_ratio: float | None
    container_processes: int | None


@dataclass(frozen=True)
class ContainerMetadata:
    """What people call the container: cAdvisor's ``name``, ``image``, ``container``, ``pod``,
    ``namespace`` labels ("" when unknown). Today only ``name`` is filled, where the cgroup path
    holds one (LXC, systemd-nspawn); the runtimes' state files are not read yet."""

    name: str = ""
    image: str = ""
    container: str = ""
    pod: str = ""
    namespace: str = ""


@dataclass
class ContainerStats:
    """One container: its cgroup path, identity, metadata, and the accelerators attributed to it."""

    cgroup: str
    identity: ContainerIdentity | None
    metadata: ContainerMetadata = field(default_factory=ContainerMetadata)
    accelerators: list[AcceleratorStats] = field(default_factory=list)
    reason: str = ""  # why nothing could be attributed (e.g. unreadable devices.list)


class AcceleratorCollector(Protocol):
    """cAdvisor's collector interface: fill one container's accelerator stats."""

    def update_stats(self, stats: ContainerStats) -> None:
        """Append this container's :class:`AcceleratorStats` to ``stats.accelerators``; never raises."""


class NoopCollector:
    """A collector that reports nothing and says why (unknown or unreadable cgroup, NVML absent)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def update_stats(self, stats: ContainerStats) -> None:
        """Leave ``stats.accelerators`` alone; record :attr:`reason` on ``stats``."""
        stats.reason = stats.reason or self.reason


def cgroup_of_pids(pids: Iterable[int], proc_root: Path, controller: str) -> dict[int, str]:
    """``{pid: cgroup path}`` from ``<proc_root>/<pid>/cgroup``; vanished or unreadable PIDs are left out."""
    found = {}
    for pid in pids:
        try:
            text = (proc_root / str(pid) / "cgroup").read_text()
        except OSError:
            continue
        parsed = parse_proc_cgroup(text)
        path = parsed.get(controller) or parsed.get("")
        if path is not None:
            found[pid] = path
    return found


class DevicesCgroupCollector:
    """Collector for a cgroup v1 container: attribution by its ``devices.list`` (spec/cgroups.md §2).

    ``directory``: the container's directory in the devices hierarchy; ``cgroup``: its path as
    ``/proc/<pid>/cgroup`` names it; ``pid_cgroups``: ``{pid: cgroup path}`` of the snapshot's GPU
    processes, for the container's own share (a process counts for the container when its cgroup
    is the container's or below it). ``on_skipped(cgroup, lines)`` is told the malformed lines the
    file had (counted once each in ``accelstats_devices_list_skipped_lines_total``).

    An unrestricted cgroup (``a *:* rwm``: privileged, or no device rules) grants every device, so
    the file proves nothing: such a container is attributed the devices its own processes are on,
    with ``attribution="process"`` (DESIGN.md "Attribution").
    """

    def __init__(self, directory: Path, cgroup: str, snapshot: DeviceSnapshot, pid_cgroups: Mapping[int, str],
                 on_skipped: Callable[[str, tuple[str, ...]], None] | None = None) -> None:
        self.directory = directory
        self.cgroup = cgroup
        self.snapshot = snapshot
        self.pid_cgroups = pid_cgroups
        self.on_skipped = on_skipped

    def update_stats(self, stats: ContainerStats) -> None:
        """Append one AcceleratorStats per GPU the ``devices.list`` grants read or write access to."""
        text = read_devices_list_text(self.directory)
        if text is None:
            stats.reason = f"devices.list not readable in {self.directory}"
            return
        by_minor = {d.minor: d for d in self.snapshot.devices if d.kind == "gpu" and d.minor is not None}
        grant, skipped = _grant(text, frozenset(by_minor))
        if skipped and self.on_skipped is not None:
            self.on_skipped(self.cgroup, skipped)
        if grant.unrestricted:
            used = [d for d in self.snapshot.devices if self._own_processes(d)]
            for device in used:
                stats.accelerators.append(self.stats_for(device, "process"))
            if not used:
                stats.reason = "unrestricted devices cgroup (a *:* rwm) and none of its processes is on a GPU"
            return
        for minor in sorted(grant.minors):
            stats.accelerators.append(self.stats_for(by_minor[minor], "devices_cgroup"))

    def _own_processes(self, device: Device) -> list[ProcessUsage] | None:
        """This container's processes on ``device`` (None when NVML's process list is not readable)."""
        sample = self.snapshot.samples.get(device.uuid)
        if sample is None or sample.processes is None:
            return None
        prefix = self.cgroup.rstrip("/") + "/"
        own = []
        for p in sample.processes:
            path = self.pid_cgroups.get(p.pid)
            if path is not None and (path == self.cgroup or path.startswith(prefix)):
                own.append(p)
        return own

    def stats_for(self, device: Device, attribution: str) -> AcceleratorStats:
        """The AcceleratorStats of ``device`` for this container, with its own process share."""
        sample = self.snapshot.samples.get(device.uuid)
        mine = self._own_processes(device)
        util = sample.utilization_ratio if sample is not None else None
        return AcceleratorStats(
            make="nvidia", model=device.name, id=device.uuid, minor=device.minor, index=device.index,
            attribution=attribution,
            memory_total_bytes=sample.memory_total_bytes if sample is not None else None,
            memory_used_bytes=sample.memory_used_bytes if sample is not None else None,
            duty_cycle=util * 100.0 if util is not None else None,
            container_memory_used_bytes=_sum_memory(mine),
            container_sm_utilization_ratio=_sum_sm(mine),
            container_processes=len(mine) if mine is not None else None,
        )


@functools.lru_cache(maxsize=4096)
def _grant(devices_list_text: str, minors: frozenset[int]) -> tuple[GpuGrant, tuple[str, ...]]:
    """(grant, skipped lines) of a ``devices.list`` text. Parsing and granting are pure and a
    host's containers share a handful of rule sets, so this is cached by text (strings cache their
    hash; the parsed rules do not)."""
    parsed = parse_devices_list(devices_list_text)
    return gpu_grant(parsed, minors, nvidia_major=NVIDIA_MAJOR), parsed.skipped_lines


def _sum_memory(procs: list[ProcessUsage] | None) -> int | None:
    if procs is None or any(p.used_memory_bytes is None for p in procs):
        return None
    return sum(p.used_memory_bytes or 0 for p in procs)


def _sum_sm(procs: list[ProcessUsage] | None) -> float | None:
    if procs is None or any(p.sm_utilization_ratio is None for p in procs):
        return None
    return sum(p.sm_utilization_ratio or 0.0 for p in procs)
